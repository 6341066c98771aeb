"""The base projections of a Llama-3-8B decode step: the vendor GEMM (`F.linear`) against slora's
`skinny_linear` (Triton), bf16, on the GPU.

For each projection (fused q/k/v, o, fused gate/up, down, lm_head) and rows 1, 16, 64: time (median of
triton's do_bench, L2 flushed before each run) and bandwidth (weight bytes / time) against the H200's
4.24 TB/s copy bandwidth, for F.linear and for the best of a sweep of skinny_linear's launch choices;
the ratio is measured in the same run. Prints one table and writes JSON.

    python benchmarks/gemm.py [--quick] [--out FILE]
"""
import argparse
import itertools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from common import RESULTS, print_table, write_json

COPY_BW = 4.24e12
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}


def time_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def sweep_configs(quick: bool) -> list[dict]:
    if quick:
        return [{"block_n": 64, "block_k": 128, "split_k": None, "num_stages": 4}]
    grid = itertools.product((32, 64, 128), (128, 256), (None, 1, 2, 4, 8), (3, 4))
    return [{"block_n": bn, "block_k": bk, "split_k": sk, "num_stages": st} for bn, bk, sk, st in grid]


def best_skinny(x: torch.Tensor, weight: torch.Tensor, want: torch.Tensor, configs: list[dict]) -> tuple[float, dict, float]:
    """(time, config, max abs error against F.linear) of the fastest config."""
    from triton.runtime.errors import OutOfResources

    from slora.kernels.skinny_linear import skinny_linear
    best = (float("inf"), {}, 0.0)
    for config in configs:
        try:
            err = (skinny_linear(x, weight, **config).float() - want).abs().max().item()
        except OutOfResources:   # tiles and stages past the multiprocessor's shared memory
            continue
        t = time_us(lambda: skinny_linear(x, weight, **config))
        if t < best[0]:
            best = (t, config, err)
    return best


def rows_for(name: str, n: int, k: int, rows: list[int], configs: list[dict]) -> list[dict]:
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x, weight).float()
        vendor = time_us(lambda: F.linear(x, weight))
        ours, config, err = best_skinny(x, weight, want, configs)
        gb = weight.numel() * weight.element_size()
        out.append({"projection": name, "rows": m, "n": n, "k": k, "vendor_us": vendor,
                    "vendor_pct_bw": 100 * gb / (vendor * 1e-6) / COPY_BW, "skinny_us": ours,
                    "skinny_pct_bw": 100 * gb / (ours * 1e-6) / COPY_BW, "speedup": vendor / ours,
                    "max_abs_err": err, "config": str(config)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        logging.warning("gemm.py measures CUDA GEMMs: no GPU here, nothing to do")
        return
    torch.manual_seed(42)
    configs = sweep_configs(args.quick)
    rows = []
    for name, (n, k) in PROJECTIONS.items():
        rows += rows_for(name, n, k, [1, 16] if args.quick else [1, 16, 64], configs)
    print_table(rows)
    write_json(Path(args.out or RESULTS / "gemm_h200.json"), {"benchmark": "gemm", "rows": rows})


if __name__ == "__main__":
    main()
