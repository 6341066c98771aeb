"""Tensor parallelism: offline decode and mixed throughput at each --tp size, with both adapter schemes
(replicated A, vLLM's default; fully sharded, S-LoRA's), and the share of rank 0's step time that the
collectives take, from a torch profile of a few decode steps.

Every configuration is an engine of its own, built, warmed up and timed one after another in one command;
every request has an adapter (round robin), greedy, `ignore_eos`, fixed lengths. `comm_pct` is the time of
the base all-reduces and `lora_comm_pct` that of the LoRA collectives (fully sharded only), over the
profiled steps' wall time: on CUDA their kernels' device time, on the CPU (gloo) their host time.

    CUDA (one GPU per rank): Llama-3-8B shape, random bf16 weights, 32 rank-16 adapters on all 7 projections
        decode   256 x (16 prompt -> 256 out)
        mixed    256 x (512 -> 128)
    CPU (gloo): a small Llama (hidden 512, 8 heads / 4 KV heads, 4 layers, float32), 8 rank-16 adapters
        decode   16 x (16 -> 32)
        mixed    16 x (128 -> 16)
    --quick: the tiny model, 4 x (8 -> 4), TP 1 and 2 (the smoke test).

    python benchmarks/tensor_parallel.py [--device cpu|cuda] [--tp 1,2,4] [--quick] [--out FILE]
"""
import argparse
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import LLAMA3_8B, PROJECTIONS, default_out, print_table, write_config, write_json, write_peft_adapter
from torch.profiler import ProfilerActivity, profile

from slora import LLM, SamplingParams
from slora.execution.tensor_parallel import BASE_ALL_REDUCE, LORA_ALL_GATHER, LORA_ALL_REDUCE
from slora.models.tiny import ensure_tiny_model

logger = logging.getLogger("benchmarks.tensor_parallel")
SMALL_LLAMA = {**LLAMA3_8B, "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}
PROFILED_STEPS = 8


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Setup:
    folder: Path
    device: str
    dtype: str
    adapters: list[Path]
    workloads: tuple[Workload, ...]
    engine: dict[str, Any]
    profiled: Workload = Workload("profile", 8, 16, PROFILED_STEPS)     # the decode steps profiled


def prepare(device: str, quick: bool, workdir: Path) -> Setup:
    if quick:
        tiny = ensure_tiny_model()
        return Setup(tiny.model_dir, "cpu", "float32", list(tiny.adapters.values()),
                     (Workload("decode", 4, 8, 4), Workload("mixed", 4, 24, 2)), {"num_pages": 256},
                     Workload("profile", 2, 8, 2))
    raw = LLAMA3_8B if device == "cuda" else SMALL_LLAMA
    count = 32 if device == "cuda" else 8
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    folder = write_config(workdir / "model", raw)
    adapters = [write_peft_adapter(workdir / f"a{i}", raw, 16, PROJECTIONS, 42 + i, dtype) for i in range(count)]
    if device == "cuda":
        loads = (Workload("decode", 256, 16, 256), Workload("mixed", 256, 512, 128))
        return Setup(folder, device, "bfloat16", adapters, loads,
                     {"load_format": "dummy", "max_num_seqs": 256, "max_loras": 32, "max_lora_rank": 16})
    loads = (Workload("decode", 16, 16, 32), Workload("mixed", 16, 128, 16))
    return Setup(folder, device, "float32", adapters, loads, {"load_format": "dummy", "max_lora_rank": 16,
                                                             "pool_gib": 1.0})


def prompts(load: Workload, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (load.requests, load.prompt_len), generator=generator).tolist()


def run_config(setup: Setup, tp: int, fully_sharded: bool) -> list[dict[str, Any]]:
    with LLM(str(setup.folder), device=setup.device, dtype=setup.dtype, tensor_parallel_size=tp,
             fully_sharded_loras=fully_sharded, **setup.engine) as llm:
        names = [f"a{i}" for i in range(len(setup.adapters))]
        for name, path in zip(names, setup.adapters):
            llm.load_adapter(name, str(path))
        vocab = llm.engine.model_config.vocab_size
        rows = []
        for index, load in enumerate(setup.workloads):
            params = SamplingParams(max_tokens=load.output_len, temperature=0, ignore_eos=True)
            adapters = [names[i % len(names)] for i in range(load.requests)]
            warm_up = min(8, load.requests)
            llm.generate(prompts(load, vocab, 1000 + index)[:warm_up], SamplingParams(max_tokens=2, temperature=0),
                         adapters=adapters[:warm_up])                                # warm-up, other prompts
            began = time.perf_counter()
            llm.generate(prompts(load, vocab, index), params, adapters=adapters)
            seconds = time.perf_counter() - began
            rows.append({"workload": load.name, "tp": tp, "scheme": _scheme(tp, fully_sharded),
                         "requests": load.requests, "gen_tok_s": load.requests * load.output_len / seconds,
                         "tok_s": load.requests * (load.prompt_len + load.output_len) / seconds, "wall_s": seconds,
                         **collective_shares(llm, setup, names, vocab)})
        return rows


def _scheme(tp: int, fully_sharded: bool) -> str:
    return "-" if tp == 1 else ("fully sharded" if fully_sharded else "replicated A")


def collective_shares(llm: LLM, setup: Setup, names: list[str], vocab: int) -> dict[str, float]:
    """The share of a few decode steps' time in the base and LoRA collectives, from a profile of rank 0."""
    load = setup.profiled
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device == "cuda" else [])
    params = SamplingParams(max_tokens=load.output_len, temperature=0, ignore_eos=True)
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        llm.generate(prompts(load, vocab, 99), params, adapters=[names[i % len(names)] for i in range(load.requests)])
        wall_us = (time.perf_counter() - began) * 1e6
    spent = {BASE_ALL_REDUCE: 0.0, LORA_ALL_REDUCE: 0.0, LORA_ALL_GATHER: 0.0}
    for event in prof.key_averages():
        if event.key in spent:
            on_device = setup.device == "cuda"
            spent[event.key] += event.device_time_total if on_device else event.cpu_time_total
    lora = spent[LORA_ALL_REDUCE] + spent[LORA_ALL_GATHER]
    return {"comm_pct": 100 * spent[BASE_ALL_REDUCE] / wall_us, "lora_comm_pct": 100 * lora / wall_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tp", default=None, help="sizes, comma-separated (default: 1,2 on the CPU, 1,2,4 on CUDA, "
                                                   "those the GPUs allow)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sizes = [int(s) for s in args.tp.split(",")] if args.tp else _default_sizes(args.device, args.quick)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as workdir:
        setup = prepare(args.device, args.quick, Path(workdir))
        for tp in sizes:
            for fully_sharded in ([False] if tp == 1 else [False, True]):
                logger.info("tp %d, %s", tp, _scheme(tp, fully_sharded))
                rows += run_config(setup, tp, fully_sharded)
    print_table(rows)
    device = "cpu" if args.quick else args.device
    write_json(Path(args.out) if args.out else default_out("tensor_parallel", device),
               {"benchmark": "tensor_parallel", "quick": args.quick, "device": args.device,
                "workloads": [load.__dict__ for load in setup.workloads], "adapters": len(setup.adapters),
                "rows": rows, "engine": json.loads(json.dumps(setup.engine))})


def _default_sizes(device: str, quick: bool) -> list[int]:
    if device == "cpu" or quick:
        return [1, 2]
    return [size for size in (1, 2, 4) if size <= torch.cuda.device_count()]


if __name__ == "__main__":
    main()
