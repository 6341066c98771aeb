"""Host (Python) time of the batched-LoRA calls of one eager step, with the Triton kernels stubbed out.

On the H200, mixed steps (prefill chunks beside decoding sequences; decode graphs do not cover them) are
bound by the host: decode.py --mixed measured 25-27 ms of GPU time in steps of 53-90 ms, and run() took
82-101 ms to return (benchmarks/results/h200/decode_mixed_host.txt). This script times what slora's own
Python adds around the LoRA launches of such a step (the engine's LoraStep.apply and TritonLora down to
the wrappers in slora.kernels.lora, for the 4 groups of 32 Llama-3-8B layers), on any machine: the
kernels are replaced by no-ops, so neither the GPU nor Triton's launcher is timed. On the CPU the split
and block choices skip their CUDA branch.

    python benchmarks/experiments/host_overhead.py [--quick] [--out FILE]
"""
import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py
from common import LLAMA3_8B, PAGE_ELEMS, PROJECTIONS, RESULTS, print_table, write_json  # noqa: E402

from slora.execution.lora_backend import LoraStep, TritonLora  # noqa: E402
from slora.execution.step_batch import StepLora  # noqa: E402
from slora.kernels import lora  # noqa: E402
from slora.models.config import parse_model_config  # noqa: E402

ADAPTER_PAGES = 40                     # pages of a rank-16 adapter on all seven projections
RANK = 16


class NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` only counts the launch."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: tuple) -> object:
        return self._launch

    def _launch(self, *args: object, **kwargs: object) -> None:
        self.launches += 1


def lora_step(tokens: int, slots: int, num_layers: int) -> LoraStep:
    """A step's LoRA for `tokens` tokens spread over `slots` adapters, every module at rank RANK."""
    token_slots = (torch.arange(tokens) % slots).to(torch.int32)
    shape = (num_layers, len(PROJECTIONS), slots)
    tables = StepLora(token_slots, torch.arange(slots * ADAPTER_PAGES, dtype=torch.int32).view(slots, -1),
                      torch.full(shape, RANK, dtype=torch.int32), torch.zeros(shape, dtype=torch.long),
                      torch.zeros(shape, dtype=torch.long), torch.ones(shape), RANK,
                      [[True] * len(PROJECTIONS)] * num_layers)
    return TritonLora().step(tables)


def step_seconds(tokens: int, slots: int, num_layers: int, repeats: int) -> float:
    """Host seconds of one step's LoRA calls (4 groups per layer), best of `repeats`."""
    cfg = parse_model_config(LLAMA3_8B)
    pool = torch.zeros(slots * ADAPTER_PAGES, PAGE_ELEMS, dtype=torch.bfloat16)
    hidden = torch.zeros(tokens, cfg.hidden_size, dtype=torch.bfloat16)
    wide = torch.zeros(tokens, cfg.intermediate_size, dtype=torch.bfloat16)
    qkv = torch.zeros(tokens, cfg.q_size + 2 * cfg.kv_size, dtype=torch.bfloat16)
    gate_up = torch.zeros(tokens, 2 * cfg.intermediate_size, dtype=torch.bfloat16)
    groups = ((slice(0, 3), hidden, qkv, [cfg.q_size, cfg.kv_size, cfg.kv_size]),
              (slice(3, 4), hidden, hidden.clone(), [cfg.hidden_size]),
              (slice(4, 6), hidden, gate_up, [cfg.intermediate_size] * 2),
              (slice(6, 7), wide, hidden.clone(), [cfg.hidden_size]))
    best = float("inf")
    for _ in range(repeats):
        batch = lora_step(tokens, slots, num_layers)      # a new step: its own workspace, as in the engine
        start = time.perf_counter()
        for layer in range(num_layers):
            for modules, x, out, sizes in groups:
                batch.apply(layer, modules, x, out, pool, sizes)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 repeats (CI)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    num_layers, repeats = (2, 2) if args.quick else (32, 20)
    # Stubbed for the rest of this process: the script runs alone, never inside the engine or the tests.
    kernels = lora._lora_shrink_kernel = lora._lora_expand_kernel = NoLaunch()
    rows = []
    for label, tokens, slots in (("decode, 64 adapters", 64, 64), ("mixed, 5 adapters", 624, 5),
                                 ("mixed, 66 adapters", 624, 66)):
        before = kernels.launches
        seconds = step_seconds(tokens, slots, num_layers, repeats)
        rows.append({"step": label, "tokens": tokens, "adapters": slots, "layers": num_layers,
                     "launches": (kernels.launches - before) // repeats, "host_ms": seconds * 1e3,
                     "per_call_us": seconds * 1e6 / (num_layers * 4 * 2)})
    print_table(rows)
    write_json(Path(args.out or RESULTS / "host_overhead.json"), {"benchmark": "host-overhead", "rows": rows})


if __name__ == "__main__":
    main()
