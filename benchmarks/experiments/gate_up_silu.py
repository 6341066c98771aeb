"""Experiment: the MLP's gate/up GEMM with SiLU(gate) * up in its epilogue (a Triton dual GEMM: each program
loads one x tile and the matching gate and up weight tiles), against the engine's cuBLAS GEMM then
silu_and_mul. Also a plain Triton GEMM of the same shape, to see Triton's rate beside cuBLAS's.

    python benchmarks/experiments/gate_up_silu.py [--tokens 8192]
"""
import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import time_us  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 14336


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return (first_m + (pid % per_group) % size_m) * BLOCK_M, ((pid % per_group) // size_m) * BLOCK_N


@triton.jit
def _dual_kernel(x_desc, g_desc, u_desc, out_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    off_m, off_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        a = x_desc.load([off_m, k])
        acc_g = tl.dot(a, g_desc.load([off_n, k]).T, acc_g)
        acc_u = tl.dot(a, u_desc.load([off_n, k]).T, acc_u)
    dtype = out_desc.dtype
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    out_desc.store([off_m, off_n], (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u)


@triton.jit
def _dual_persistent_kernel(x_desc, g_desc, u_desc, out_desc, M, N, K, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            STAGES: tl.constexpr, NUM_SMS: tl.constexpr):
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    dtype = out_desc.dtype
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):
        off_m, off_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            a = x_desc.load([off_m, k])
            acc_g = tl.dot(a, g_desc.load([off_n, k]).T, acc_g)
            acc_u = tl.dot(a, u_desc.load([off_n, k]).T, acc_u)
        g = acc_g.to(dtype).to(tl.float32)
        u = acc_u.to(dtype).to(tl.float32)
        out_desc.store([off_m, off_n], (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u)


@triton.jit
def _plain_kernel(x_desc, w_desc, out_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    off_m, off_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
    out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def dual(x, w, bm, bn, bk, group, stages, warps, persistent=False):
    m, k = x.shape
    n = w.shape[0] // 2
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    descs = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w[:n], [bn, bk]),
             TensorDescriptor.from_tensor(w[n:], [bn, bk]), TensorDescriptor.from_tensor(out, [bm, bn]))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if persistent:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        _dual_persistent_kernel[(min(sms, tiles),)](*descs, m, n, k, bm, bn, bk, group, stages, sms,
                                                    num_warps=warps)
    else:
        _dual_kernel[(tiles,)](*descs, m, n, k, bm, bn, bk, group, stages, num_warps=warps)
    return out


def plain(x, w, bm, bn, bk, group, stages, warps):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    descs = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
             TensorDescriptor.from_tensor(out, [bm, bn]))
    _plain_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](*descs, m, n, k, bm, bn, bk, group, stages,
                                                               num_warps=warps)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from slora.kernels.fused_ops import silu_and_mul

    torch.manual_seed(0)
    m = args.tokens
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    flops = 2 * m * HIDDEN * 2 * INTERMEDIATE
    rows = []

    def record(name, fn, check=None):
        try:
            us = time_us(fn)
            err = None if check is None else check(fn())
        except Exception as exc:  # noqa: BLE001 - an experiment: a config that fails to compile is reported
            rows.append({"name": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            print(rows[-1], flush=True)
            return
        rows.append({"name": name, "us": us, "tflop_s": flops / us / 1e6, "max_err": err})
        print(rows[-1], flush=True)

    ref = silu_and_mul(torch.nn.functional.linear(x, w))
    check = lambda out: float((out.float() - ref.float()).abs().max())  # noqa: E731
    record("cublas gemm", lambda: torch.nn.functional.linear(x, w))
    record("cublas gemm + silu_and_mul (engine)", lambda: silu_and_mul(torch.nn.functional.linear(x, w)), check)
    half = w[:INTERMEDIATE].contiguous()
    record("cublas gemm, one half (x2 for the pair)", lambda: torch.nn.functional.linear(x, half))
    for bm, bn, bk, group, stages, warps in [(128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8),
                                             (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 4, 8)]:
        record(f"triton plain {bm}x{bn}x{bk} g{group} s{stages} w{warps}",
               lambda c=(bm, bn, bk, group, stages, warps): plain(x, w, *c))
    configs = list(itertools.product([128], [128, 64], [64], [8], [3, 4], [8])) + [(128, 128, 64, 16, 3, 8),
                                                                                   (64, 128, 64, 8, 4, 4)]
    for bm, bn, bk, group, stages, warps in configs:
        c = (bm, bn, bk, group, stages, warps)
        record(f"triton dual {bm}x{bn}x{bk} g{group} s{stages} w{warps}", lambda c=c: dual(x, w, *c), check)
        record(f"triton dual persistent {bm}x{bn}x{bk} g{group} s{stages} w{warps}",
               lambda c=c: dual(x, w, *c, persistent=True), check)
    if args.out:
        Path(args.out).write_text(json.dumps({"tokens": m, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
