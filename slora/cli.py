"""Command line: `slora generate` (offline) and `slora serve` (HTTP)."""
import argparse
import logging
import sys

from slora.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face folder (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pool-gib", type=float, default=0.25, help="pool size on the CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-lora-rank", type=int, default=64)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                pool_gib=args.pool_gib, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_lora_rank=args.max_lora_rank)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slora", description="multi-LoRA LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts offline and print the completions")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="*", default=["Hello, how are you?"])
    gen.add_argument("--adapter", default=None, help="adapter name (the embedded model has demo-r4-attn, "
                     "demo-r8-mlp, demo-r16-all)")
    gen.add_argument("--load-adapter", action="append", default=[], metavar="NAME=PATH",
                     help="load a PEFT folder under NAME first (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from slora.llm import LLM

    llm = LLM(**engine_kwargs(args))
    for spec in args.load_adapter:
        name, _, path = spec.partition("=")
        llm.load_adapter(name, path)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    outputs = llm.generate(args.prompts, params, adapters=[args.adapter] * len(args.prompts))
    for prompt, output in zip(args.prompts, outputs):
        sys.stdout.write(f"{prompt!r} -> {output.text!r} [{output.finish_reason}]\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
    except ValueError as exc:          # bad input: a clear message, not a traceback
        sys.stderr.write(f"slora: error: {exc}\n")
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
