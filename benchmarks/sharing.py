"""Memory and work saved by sharing: the prefix cache on a shared system prompt, and copy-on-write
samples (n = 4, 8) against the same work without sharing. Same engine, same prompts, one run.

    python benchmarks/sharing.py [--quick] [--device cpu|cuda] [--out FILE]
"""
import argparse
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import default_out, print_table, write_json

from slora import LLM, SamplingParams
from slora.models.builtin import TINY_MODEL


@dataclass
class Measured:
    peak_kv_pages: int
    prompt_tokens_computed: int
    output_tokens: int
    seconds: float


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams, str | None]]) -> Measured:
    """Run requests to the end, stepping the engine to watch the KV pages."""
    engine = llm.engine
    computed_before = engine.num_prompt_tokens_computed
    for i, (prompt, params, adapter) in enumerate(requests):
        engine.add_request(f"req-{i}", prompt, params, adapter)
    peak, outputs, start = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs += sum(len(o.token_ids) for o in out.outputs)
        peak = max(peak, llm.pool_stats()["kv_pages"])
    return Measured(peak, engine.num_prompt_tokens_computed - computed_before, outputs,
                    time.perf_counter() - start)


def make_llm(device: str, **kwargs: object) -> LLM:
    """A fresh engine; the previous one must be gone, since on CUDA each sizes its pool from free memory."""
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    return LLM(TINY_MODEL, device=device, **kwargs)


def random_tokens(count: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, 500, (count,), generator=generator).tolist()


def system_prompt_case(llm: LLM, mode: str, num_requests: int, system_len: int) -> dict:
    generator = torch.Generator().manual_seed(42)
    system = random_tokens(system_len, generator)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    requests = [(system + random_tokens(24, generator), params, "demo-r16-all") for _ in range(num_requests)]
    run(llm, requests[:1])                                   # warm-up, and the first copy of the prefix
    return row("system prompt", mode, run(llm, requests[1:]))


def samples_case(llm: LLM, n: int, prompt_len: int) -> list[dict]:
    generator = torch.Generator().manual_seed(43)
    prompt = random_tokens(prompt_len, generator)
    forked = [(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1, n=n, ignore_eos=True), "demo-r8-mlp")]
    separate = [(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1 + i, ignore_eos=True), "demo-r8-mlp")
                for i in range(n)]
    run(llm, separate[:1])                                       # warm-up
    return [row(f"n={n}", mode, run(llm, requests))
            for mode, requests in (("separate requests", separate), ("copy-on-write fork", forked))]


def row(workload: str, mode: str, m: Measured) -> dict:
    return {"workload": workload, "mode": mode, "peak_kv_pages": m.peak_kv_pages,
            "prompt_tokens_computed": m.prompt_tokens_computed, "output_tokens": m.output_tokens,
            "tokens_per_s": m.output_tokens / m.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    num_requests, system_len = (6, 64) if args.quick else (32, 256)
    # One engine without the prefix cache for every case but the cached system prompt, which gets its own: each
    # run ends with every request finished, its pages back in the free list.
    plain = make_llm(args.device, enable_prefix_caching=False)
    rows = [system_prompt_case(plain, "no sharing", num_requests, system_len)]
    for n in (4, 8):
        rows += samples_case(plain, n, 48 if args.quick else 200)
    del plain
    cached = make_llm(args.device, enable_prefix_caching=True)
    rows.insert(1, system_prompt_case(cached, "prefix cache", num_requests, system_len))
    del cached
    print_table(rows)
    out = Path(args.out) if args.out else default_out("sharing", args.device)
    write_json(out, {"benchmark": "sharing", "quick": args.quick, "device": args.device, "rows": rows})


if __name__ == "__main__":
    main()
