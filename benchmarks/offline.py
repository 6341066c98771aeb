"""Offline generation: slora against transformers + PEFT mixed-adapter `generate`, same prompts, same
adapters, same machine, in one run. The model's demo adapters are mixed with the base model in every batch
(SmolLM2-135M-Instruct and its three trained adapters by default); random prompts of equal length (no
padding for PEFT), greedy, ignore_eos. slora's decode steps are also reported on their own: tokens/s and
the bytes they had to read per second, against the GPU's copy bandwidth.

--random-weights CONFIG runs the model of that config.json with random weights in both systems (a machine
without the model's files, such as the GPU machine: the throughput does not depend on the weights'
values, and the demo adapters still fit the shapes).

    python benchmarks/offline.py [--quick] [--model NAME] [--device cuda] [--batches 64,256]
                                 [--random-weights benchmarks/smollm2_config.json] [--no-peft] [--out FILE]
"""
import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from common import RESULTS, bandwidth_columns, machine, print_table, write_json

from slora import LLM, SamplingParams
from slora.core.step_stats import StepStats
from slora.models.builtin import DEFAULT_MODEL, resolve_model, shipped_demo_adapters


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 42) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (prompt_len,), generator=generator).tolist() for _ in range(batch)]


def adapter_mix(batch: int, adapters: list[str]) -> list[str | None]:
    names = [*adapters, None]
    return [names[i % len(names)] for i in range(batch)]


def run_slora(llm: LLM, prompts: list[list[int]], names: list[str | None], new_tokens: int,
              on_gpu: bool) -> dict[str, float]:
    """End-to-end tokens/s, the decode steps' tokens/s and, on a GPU, their bytes read per second against
    its copy bandwidth (a figure of the H200, meaningless for a CPU)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.engine.step_stats = StepStats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, adapters=names)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outputs)
    stats = llm.engine.step_stats
    decode_s = stats.seconds["decode"]
    row = {"slora_tok_s": len(prompts) * new_tokens / elapsed,
           "slora_decode_tok_s": stats.tokens["decode"] / decode_s if decode_s else None}
    return {**row, **bandwidth_columns(stats.decode_bytes, decode_s, "slora_decode")} if on_gpu else row


def build_peft(model: torch.nn.Module, adapters: dict[str, Path]) -> torch.nn.Module:
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(model, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


@torch.inference_mode()
def run_peft(model: torch.nn.Module, prompts: list[list[int]], names: list[str | None], new_tokens: int) -> float:
    device = next(model.parameters()).device
    input_ids = torch.tensor(prompts, device=device)       # equal lengths: no padding needed
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         adapter_names=[n or "__base__" for n in names], max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / elapsed


class Systems(NamedTuple):
    llm: LLM
    peft: torch.nn.Module | None            # None with --no-peft
    adapters: list[str]                     # the demo adapters' names
    vocab_size: int


def load_systems(args: argparse.Namespace, workdir: Path) -> Systems:
    """Both systems on the same model and demo adapters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.random_weights:
        folder = workdir / "model"
        folder.mkdir()
        (folder / "config.json").write_text(Path(args.random_weights).read_text())
        adapters = shipped_demo_adapters()
        llm = LLM(str(folder), device=args.device, load_format="dummy", max_num_seqs=max(args.batches))
        for name, path in adapters.items():
            llm.load_adapter(name, str(path))
        hf = None if args.no_peft else AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)),
                                                                       dtype=dtype)
    else:
        source = resolve_model(args.model)
        folder, adapters = source.folder, source.demo_adapters
        llm = LLM(args.model, device=args.device, max_num_seqs=max(args.batches))
        hf = None if args.no_peft else AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=dtype)
    peft = None if hf is None else build_peft(hf.to(args.device).eval(), adapters)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    return Systems(llm, peft, list(adapters), vocab_size)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a builtin model with demo adapters")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--random-weights", default=None, metavar="CONFIG_JSON")
    parser.add_argument("--no-peft", action="store_true", help="slora alone")
    parser.add_argument("--out", default=str(RESULTS / "offline_cpu.json"))
    args = parser.parse_args()
    args.batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.prompt_len, args.new_tokens = 16, 8
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(42)
    with tempfile.TemporaryDirectory() as tmp:
        llm, peft_model, adapters, vocab_size = load_systems(args, Path(tmp))
        rows = []
        for batch in args.batches:
            prompts = make_prompts(batch, args.prompt_len, vocab_size)
            names = adapter_mix(batch, adapters)
            on_gpu = args.device != "cpu"
            run_slora(llm, prompts[:1], names[:1], 2, on_gpu)      # warm-up
            row = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   **run_slora(llm, prompts, names, args.new_tokens, on_gpu)}
            if peft_model is not None:
                row["peft_tok_s"] = run_peft(peft_model, prompts, names, args.new_tokens)
                row["ratio"] = row["slora_tok_s"] / row["peft_tok_s"]
            rows.append(row)
    print_table(rows)
    write_json(Path(args.out), {"benchmark": "offline", "quick": args.quick, "model": args.model,
                                "random_weights": args.random_weights, "device": args.device,
                                "machine": machine(), "threads": torch.get_num_threads(),
                                "adapters": adapters, "rows": rows})


if __name__ == "__main__":
    main()
