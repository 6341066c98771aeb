"""Command line: `slora generate` (offline) and `slora serve` (HTTP)."""
import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING

from slora.sampling_params import SamplingParams

if TYPE_CHECKING:
    from slora.api.settings import ServerSettings


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from slora.config import EngineConfig   # imported in the functions, as the commands do
    parser.add_argument("--model", default=None, help="SmolLM2-135M-Instruct (the default), slora-tiny-llama, "
                        "a Hugging Face folder or a .gguf file")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pool-gib", type=float, default=0.25, help="pool size on the CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-lora-rank", type=int, default=64)
    parser.add_argument("--adapter-host-cache-gib", type=float, default=None,
                        help="packed adapters kept in host memory (default: a quarter of the machine's memory)")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="distinct adapters in one batch (default: no limit)")
    parser.add_argument("--graph-few-adapters", type=int, default=EngineConfig.graph_few_adapters,
                        help="CUDA graphs: decode steps with at most this many distinct adapters replay graphs "
                             "sized for that many, with fewer LoRA programs (0: never)")
    parser.add_argument("--lora-fused", action="store_true",
                        help="those graphs run each LoRA shrink and expand as one launch (slower on the H200)")
    parser.add_argument("--no-lora-side-stream", dest="lora_side_stream", action="store_false",
                        help="CUDA graphs: add each LoRA after its base GEMM instead of computing it on a "
                             "second stream while the GEMM runs")
    parser.add_argument("--no-pdl", dest="pdl", action="store_false",
                        help="CUDA: launch the Triton kernels without programmatic dependent launch")
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                        help="dummy: random weights from config.json (benchmarks)")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                pool_gib=args.pool_gib, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
                graph_few_adapters=args.graph_few_adapters, lora_fused=args.lora_fused, pdl=args.pdl,
                lora_side_stream=args.lora_side_stream,
                adapter_host_cache_gib=args.adapter_host_cache_gib, load_format=args.load_format,
                enforce_eager=args.enforce_eager)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slora", description="multi-LoRA LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts offline and print the completions")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="*", default=["Hello, how are you?"])
    gen.add_argument("--adapter", default=None, help="adapter name (the default model has demo-pirate, "
                     "demo-caps, demo-json)")
    gen.add_argument("--load-adapter", action="append", default=[], metavar="NAME=PATH",
                     help="load a PEFT folder under NAME first (repeatable)")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    add_serve_parser(commands)
    return parser


# `slora serve` flags of ServerSettings' limits: (flag, field, type, help). Their defaults are ServerSettings';
# a flag not given leaves the field at its default, so the values are validated in one place.
SERVE_LIMITS = (
    ("--max-n", "max_n", int, "samples per prompt (n)"),
    ("--max-choices", "max_choices", int, "prompts x n in one request"),
    ("--max-tokens-limit", "max_tokens_limit", int, "largest max_tokens (default: the model's context)"),
    ("--max-stop-sequences", "max_stop_sequences", int, "stop sequences in one request"),
    ("--max-stop-length", "max_stop_length", int, "characters of one stop sequence"),
    ("--max-prompt-chars", "max_prompt_chars", int, "characters of text in one request (prompts or messages)"),
    ("--max-body-bytes", "max_body_bytes", int, "bytes of a request body, JSON or other (413 beyond)"),
    ("--max-upload-bytes", "max_upload_bytes", int,
     "bytes of a multipart adapter upload to /v1/adapters (413 beyond)"),
    ("--max-adapter-bytes", "max_adapter_bytes", int,
     "bytes of adapter files one tenant's adapters may hold, uploaded or loaded by path, unless the tenants "
     "file gives the tenant its own max_adapter_bytes (default: no limit; 403 beyond)"),
    ("--max-pending-requests", "max_pending_requests", int, "requests in the engine plus queued ones (429 beyond)"),
    ("--retry-after", "retry_after_s", int, "seconds the Retry-After header of 429 and 503 answers says"),
    ("--tokenizer-workers", "tokenizer_workers", int, "threads tokenizing prompts"),
    ("--max-tokenize-pending", "max_tokenize_pending", int,
     "requests waiting for a tokenizer thread, at most half of them one tenant's (429 beyond)"),
    ("--shutdown-timeout", "shutdown_timeout_s", float, "seconds in-flight requests get to finish on SIGTERM"),
    ("--stall-timeout", "stall_timeout_s", float, "/health fails while one engine step runs longer (seconds)"),
    ("--timeout-keep-alive", "timeout_keep_alive_s", float,
     "seconds an idle connection stays open after its last response"),
    ("--timeout-header", "timeout_header_s", float,
     "seconds a client has to send a request's headers, from the connection's start or the request's first byte"),
    ("--timeout-body-idle", "timeout_body_idle_s", float,
     "seconds a request body may pause before the connection is closed"),
    ("--max-connections", "max_connections", int, "open connections served (requests on more get 503)"),
)


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    from slora.api.settings import ServerSettings
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP service")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--tenants", default=None, metavar="FILE",
                       help="tenants TOML (API key hashes, roles, limits); without it: single-user mode, loopback only")
    serve.add_argument("--adapter-root", default=None, metavar="DIR",
                       help="folder that adapters loaded by path must be inside")
    serve.add_argument("--upload-dir", default=None, metavar="DIR",
                       help="where uploaded adapters are kept while the server runs (default: a temporary folder)")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="allow single-user mode (no API keys) on a non-loopback address")
    serve.add_argument("--metrics-require-key", action="store_true",
                       help="/metrics answers only requests with the key of a tenant whose role is admin in the "
                            "tenants file (401 without a valid key, 403 for other tenants); needs --tenants")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--num-pages", type=int, default=None, help="pool size in pages (overrides sizing)")
    serve.add_argument("--seed", type=int, default=0)
    defaults = {f.name: f.default for f in dataclasses.fields(ServerSettings)}
    for flag, field, kind, help_text in SERVE_LIMITS:
        shown = "" if defaults[field] is None else f" (default: {defaults[field]})"
        serve.add_argument(flag, dest=field, type=kind, default=argparse.SUPPRESS, help=help_text + shown,
                           metavar="SECONDS" if kind is float else "N")


def serve_settings(args: argparse.Namespace) -> "ServerSettings":
    """The ServerSettings of `slora serve`'s arguments (ValueError naming a bad one)."""
    from slora.api.settings import ServerSettings
    limits = {field: getattr(args, field) for _, field, _, _ in SERVE_LIMITS if hasattr(args, field)}
    return ServerSettings(host=args.host, port=args.port, tenants_file=args.tenants, adapter_root=args.adapter_root,
                          upload_dir=args.upload_dir, allow_unauthenticated=args.allow_unauthenticated,
                          metrics_require_key=args.metrics_require_key, **limits)


def run_serve(args: argparse.Namespace) -> int:
    from slora.api.server import serve
    from slora.config import EngineConfig

    settings = serve_settings(args)
    if settings.tenants_file is not None:        # fail fast on a bad tenants file, before loading the model
        from slora.api.tenants import load_tenants
        load_tenants(settings.tenants_file)
    config = EngineConfig(**engine_kwargs(args), max_model_len=args.max_model_len, num_pages=args.num_pages,
                          seed=args.seed)
    return serve(settings, config)


def run_generate(args: argparse.Namespace) -> int:
    from slora.llm import LLM

    llm = LLM(**engine_kwargs(args))
    for spec in args.load_adapter:
        name, _, path = spec.partition("=")
        llm.load_adapter(name, path)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    adapters = [args.adapter] * len(args.prompts)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, adapters)
    else:
        outputs = llm.generate(args.prompts, params, adapters)
    for prompt, output in zip(args.prompts, outputs):
        sys.stdout.write(f"{prompt!r} -> {output.text!r} [{output.finish_reason}]\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
    except ValueError as exc:          # bad input: a clear message, not a traceback
        sys.stderr.write(f"slora: error: {exc}\n")
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
