"""Where one prefill layer of the Llama-3-8B shape spends its GPU time, kernel by kernel,
with the engine's own kernels at the engine's step size.

On a CUDA GPU, for `--tokens` new tokens (default 8,192: eight 1,024-token prompts, a step of the
prefill workload of engine_throughput.py) in bf16:
- the four GEMMs (torch's, as the model runs them): TFLOP/s against the measured 810 TFLOP/s peak;
- o and down as the engine runs them, added into the residual stream in place;
- the fused elementwise kernels (the norm of x alone, rotary storing the new K/V into the pool,
  silu-and-mul): TB/s against the 4.24 TB/s copy bandwidth;
- prefill attention: K/V through the block tables and, as the engine runs it, the new tokens' K/V from the
  step's own rows, with queries of their own or as the q columns of q/k/v (the engine's layout), and timed
  right after the gate/up GEMM (the pair's row less the GEMM's is the attention as the engine sees it);
  other launches; torch's FlashAttention-2 varlen over the step's rows, and torch's
  SDPA by backend (default, cuDNN, flash) on contiguous K/V, with 32 K/V heads or GQA;
- a mixed step's attention (255 decodes at context 600 beside one prefill chunk): every row through the
  prefill kernel, against the engine's way: the decode rows through the paged decode kernel, the rest
  through the prefill kernel reading the step's keys and values from its own rows;
- the layer's sum times 32 layers: the step's GPU time, its share in GEMMs, and the prompts per second
  that it allows.

--gemm-variants adds each GEMM with its weight stored transposed and through cuBLASLt; --gemm-pieces the
gate/up and down GEMMs cut by rows or columns into pieces that write one output.

    python benchmarks/prefill.py [--quick] [--tokens N] [--gemm-variants] [--gemm-pieces] [--out FILE]
"""
import argparse
import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import COPY_BANDWIDTH, default_out, print_table, time_us, write_json
from torch import Tensor

logger = logging.getLogger("benchmarks.prefill")
PEAK_FLOPS = 810e12                  # bf16 matmul 8192^3, measured on the H200
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 4096, 32, 8, 128, 14336, 32
PAGE_SIZE, PROMPT_LEN = 16, 1024
DTYPE = torch.bfloat16
GEMMS = {"qkv": (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
         "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}    # name -> (out, in)
RESIDUAL_GEMMS = ("o", "down")       # the engine adds these into the residual stream in place
MIXED_DECODES, MIXED_CONTEXT = 255, 600
# The attention row of the engine's path, which the layer's sum counts.
ROTARY_STORE = "rotary_qk_, K/V stored into the pool"
ENGINE_ATTENTION = "prefill attention, new K/V from the step's rows, default launch (the engine's)"


def randn(*shape: int) -> Tensor:
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def row(name: str, fn: Callable[[], object], flops: float = 0.0, bytes_moved: float = 0.0) -> dict[str, Any]:
    """The kernel's median time, and its rate against the peak (flops) or the bandwidth (bytes_moved)."""
    us = time_us(fn)
    return {"kernel": name, "us": us,
            "tflop_s": flops / us / 1e6 if flops else None,
            "pct_peak": 100 * flops / (us * 1e-6) / PEAK_FLOPS if flops else None,
            "tb_s": bytes_moved / us / 1e6 if bytes_moved else None,
            "pct_bw": 100 * bytes_moved / (us * 1e-6) / COPY_BANDWIDTH if bytes_moved else None}


def gemm_rows(tokens: int) -> list[dict[str, Any]]:
    """The four GEMMs as `x @ Wᵀ`, and o and down as the engine runs them: added into the residual stream in
    place (`residual.addmm_`, cuBLAS's beta = 1)."""
    x = {k: randn(tokens, k) for k in {HIDDEN, INTERMEDIATE}}
    residual = randn(tokens, HIDDEN)
    rows = []
    for name, (n, k) in GEMMS.items():
        weight = randn(n, k) * 0.02
        rows.append(row(f"gemm {name} [{tokens}x{k}]x[{k}x{n}]",
                        lambda w=weight, a=x[k]: torch.nn.functional.linear(a, w), flops=2 * tokens * n * k))
        if name in RESIDUAL_GEMMS:
            rows.append(row(gemm_into_residual(name),
                            lambda w=weight, a=x[k]: residual.addmm_(a, w.t()), flops=2 * tokens * n * k))
    return rows


def gemm_into_residual(name: str) -> str:
    return f"gemm {name} into the residual"


def gemm_variant_rows(tokens: int) -> list[dict[str, Any]]:
    """Each GEMM in other forms than the model's `x @ Wᵀ` through torch's default BLAS: the weight stored
    transposed (`x @ W`, another cuBLAS layout), and either form through cuBLASLt."""
    rows = []
    default = torch.backends.cuda.preferred_blas_library()
    for name, (n, k) in GEMMS.items():
        x, weight = randn(tokens, k), randn(n, k) * 0.02
        transposed = weight.t().contiguous()                          # [k, n]
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            rows.append(row(f"gemm {name} x @ W.T, {library}", lambda: torch.nn.functional.linear(x, weight),
                            flops=2 * tokens * n * k))
            rows.append(row(f"gemm {name} x @ W (stored [k, n]), {library}", lambda: x @ transposed,
                            flops=2 * tokens * n * k))
    torch.backends.cuda.preferred_blas_library(default)
    return rows


def gemm_piece_rows(tokens: int) -> list[dict[str, Any]]:
    """The gate/up and down projections as row_parts x col_parts GEMMs, each writing its block of one
    `[tokens, out]` output in place (torch.mm into a strided view: no copy), against the one GEMM: whether
    cuBLAS runs a piece of the step's largest GEMMs nearer the peak than the whole."""
    rows = []
    for name in ("gate_up", "down"):
        n, k = GEMMS[name]
        x, weight, out = randn(tokens, k), randn(n, k) * 0.02, randn(tokens, n)
        for row_parts, col_parts in ((1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)):
            blocks = gemm_blocks(tokens, n, row_parts, col_parts)

            def pieces(blocks: list[tuple[slice, slice]] = blocks, x: Tensor = x, weight: Tensor = weight,
                       out: Tensor = out) -> None:
                for r, c in blocks:
                    torch.mm(x[r], weight[c].t(), out=out[r, c])
            rows.append(row(f"gemm {name} as {row_parts} x {col_parts} pieces", pieces, flops=2 * tokens * n * k))
    return rows


def gemm_blocks(tokens: int, n: int, row_parts: int, col_parts: int) -> list[tuple[slice, slice]]:
    row_step, col_step = -(-tokens // row_parts), -(-n // col_parts)
    return [(slice(r, r + row_step), slice(c, c + col_step))
            for r in range(0, tokens, row_step) for c in range(0, n, col_step)]


def elementwise_rows(tokens: int) -> list[dict[str, Any]]:
    from slora.kernels import fused_ops
    from slora.kernels.reference import PagedKV
    two = DTYPE.itemsize
    x, weight = randn(tokens, HIDDEN), torch.ones(HIDDEN, device="cuda", dtype=DTYPE)
    qkv = randn(tokens, GEMMS["qkv"][0])
    angles = torch.randn(tokens, HEAD_DIM, device="cuda")
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    gate_up = randn(tokens, 2 * INTERMEDIATE)
    pages = math.ceil(tokens / PAGE_SIZE) + 1
    pool = torch.zeros(pages, 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM, device="cuda", dtype=DTYPE)
    kv = PagedKV(pool, torch.arange(tokens, device="cuda") + PAGE_SIZE, PAGE_SIZE)
    # Reads q, k and v; writes q and k back, and k and v into the pool.
    rotary_elems = (2 * HEADS + 5 * KV_HEADS) * HEAD_DIM
    return [row("rms_norm (x alone)", lambda: fused_ops.rms_norm(x, weight, 1e-5),
                bytes_moved=2 * tokens * HIDDEN * two),
            row(ROTARY_STORE, lambda: fused_ops.rotary_qk_(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM, kv=kv),
                bytes_moved=tokens * rotary_elems * two),
            row("silu_and_mul", lambda: fused_ops.silu_and_mul(gate_up), bytes_moved=3 * tokens * INTERMEDIATE * two)]


def paged_kv(lengths: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """A pool of random K/V for sequences of these lengths on shuffled pages: (pool, block tables, lengths)."""
    blocks = [math.ceil(n / PAGE_SIZE) for n in lengths]
    pool = randn(sum(blocks) + 1, 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM)
    order = (torch.randperm(sum(blocks)) + 1).to(torch.int32)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = order[start:start + count]
        start += count
    return pool, tables.cuda(), torch.tensor(lengths, dtype=torch.int32, device="cuda")


def start_locs(new_tokens: list[int]) -> Tensor:
    return torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def step_kv(tokens: int) -> tuple[Tensor, Tensor]:
    """The step's keys and values as the model has them: column slices of the fused q/k/v output."""
    qkv = randn(tokens, GEMMS["qkv"][0])
    key = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
    return key, qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(-1, KV_HEADS, HEAD_DIM)


def causal_flops(new: int, context: int) -> float:
    """Attention FLOPs of `new` queries ending a context of `context` tokens (QK and PV, causal)."""
    keys = new * (context - new) + new * (new + 1) / 2
    return 4 * HEADS * HEAD_DIM * keys


def attention_rows(tokens: int) -> list[dict[str, Any]]:
    from slora.kernels.prefill_attention import PrefillLaunch, default_launch, prefill_attention
    seqs = max(tokens // PROMPT_LEN, 1)
    length = tokens // seqs
    pool, tables, lens = paged_kv([length] * seqs)
    query, out = randn(seqs * length, HEADS, HEAD_DIM), randn(seqs * length, HEADS, HEAD_DIM)
    loc = start_locs([length] * seqs)
    flops = seqs * causal_flops(length, length)
    scale = HEAD_DIM ** -0.5

    key, value = step_kv(seqs * length)

    def ours(launch: PrefillLaunch | None = None, new_kv: bool = False) -> Callable[[], object]:
        return lambda: prefill_attention(query, pool, tables, loc, lens, PAGE_SIZE, KV_HEADS, scale, out=out,
                                         launch=launch, new_kv=(key, value) if new_kv else None)
    default = default_launch(query, seqs)
    rows = [row(f"prefill attention {seqs} x {length}, default {tuple(default)}", ours(), flops=flops),
            row(ENGINE_ATTENTION, ours(new_kv=True), flops=flops)]
    # The engine's queries are not a tensor of their own but the q columns of the fused q/k/v output.
    q_columns = randn(seqs * length, GEMMS["qkv"][0])[:, :HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
    rows.append(row("prefill attention, new K/V, queries as the q columns of q/k/v", lambda: prefill_attention(
        q_columns, pool, tables, loc, lens, PAGE_SIZE, KV_HEADS, scale, out=out, new_kv=(key, value)), flops=flops))
    # In the engine the attention follows GEMMs that hold the GPU at its power limit: this pair, less the
    # GEMM's own row, is the attention's time there.
    n, k = GEMMS["gate_up"]
    x, weight = randn(seqs * length, k), randn(n, k) * 0.02

    def gemm_then_attention() -> None:
        torch.nn.functional.linear(x, weight)
        ours(new_kv=True)()
    rows.append(row("gemm gate_up alone (for the row below)", lambda: torch.nn.functional.linear(x, weight)))
    rows.append(row("gemm gate_up, then the engine's attention", gemm_then_attention))
    for launch in (PrefillLaunch(128, 64, 8, 2), PrefillLaunch(128, 64, 8, 3), PrefillLaunch(128, 128, 8, 2),
                   PrefillLaunch(64, 64, 4, 3), PrefillLaunch(128, 32, 4, 3)):
        rows.append(row(f"prefill attention, launch {tuple(launch)}", ours(launch), flops=flops))
        rows.append(row(f"prefill attention, new K/V, launch {tuple(launch)}", ours(launch, True), flops=flops))
    return rows + torch_attention_rows(query, key, value, loc, length, flops)


def torch_attention_rows(query: Tensor, key: Tensor, value: Tensor, loc: Tensor, length: int,
                         flops: float) -> list[dict[str, Any]]:
    """torch's attention kernels on the same step: FlashAttention-2's varlen forward over the step's rows
    (8 K/V heads), and SDPA by backend over contiguous `[seqs, heads, length, head_dim]` tensors, its K/V
    heads repeated to the query's 32 or, where the backend takes it, GQA."""
    from torch.nn.attention import SDPBackend
    sdpa = torch.nn.functional.scaled_dot_product_attention
    seqs = query.shape[0] // length

    def varlen() -> object:
        return torch.ops.aten._flash_attention_forward(query, key, value, loc, loc, length, length, 0.0, True,
                                                       False, scale=HEAD_DIM ** -0.5)
    rows = [row("torch FlashAttention-2 varlen, step's rows, 8 K/V heads", varlen, flops=flops)]
    q = query.view(seqs, length, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    kv = randn(2, seqs, HEADS, length, HEAD_DIM)
    gqa = kv[:, :, :KV_HEADS].contiguous()
    for name, backend in (("default", None), ("cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("flash (FA2)", SDPBackend.FLASH_ATTENTION)):
        for label, k, v, enable_gqa in (("32 K/V heads", kv[0], kv[1], False), ("GQA", gqa[0], gqa[1], True)):
            rows += attempt(f"torch SDPA ({name}), contiguous, {label}", backend,
                            lambda k=k, v=v, g=enable_gqa: sdpa(q, k, v, is_causal=True, enable_gqa=g), flops)
    return rows


def attempt(name: str, backend: Any, fn: Callable[[], object], flops: float) -> list[dict[str, Any]]:
    """The row of fn under an SDPA backend (None: torch's choice), or none where that backend refuses."""
    from torch.nn.attention import sdpa_kernel
    try:
        with contextlib.nullcontext() if backend is None else sdpa_kernel(backend):
            return [row(name, fn, flops=flops)]
    except RuntimeError as error:
        logger.info("%s: not run (%s)", name, str(error).splitlines()[0])
        return []


def mixed_attention_rows(tokens: int) -> list[dict[str, Any]]:
    """One mixed step's attention: MIXED_DECODES decode rows at MIXED_CONTEXT, then one prefill chunk."""
    from slora.kernels.paged_attention import paged_attention
    from slora.kernels.prefill_attention import prefill_attention
    chunk = tokens - MIXED_DECODES
    pool, tables, lens = paged_kv([MIXED_CONTEXT] * MIXED_DECODES + [chunk])
    loc = start_locs([1] * MIXED_DECODES + [chunk])
    query, out = randn(tokens, HEADS, HEAD_DIM), randn(tokens, HEADS, HEAD_DIM)
    scale, d = HEAD_DIM ** -0.5, MIXED_DECODES
    flops = d * causal_flops(1, MIXED_CONTEXT) + causal_flops(chunk, chunk)

    def one_launch() -> None:
        prefill_attention(query, pool, tables, loc, lens, PAGE_SIZE, KV_HEADS, scale, out=out)

    def split() -> None:
        paged_attention(query[:d], pool, tables[:d], lens[:d], PAGE_SIZE, KV_HEADS, scale,
                        max_context_len=MIXED_CONTEXT, out=out[:d])
        prefill_attention(query, pool, tables[d:], loc[d:], lens[d:], PAGE_SIZE, KV_HEADS, scale, out=out,
                          new_kv=new_kv)
    new_kv = step_kv(tokens)
    return [row(f"mixed attention {d} decodes + {chunk}, all rows through prefill", one_launch, flops=flops),
            row("mixed attention, decodes through paged decode, new K/V (the engine's)", split, flops=flops)]


def layer_summary(rows: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """The layer's kernels once each as the engine runs them (o and down into the residual, the norm twice
    on x alone), times the layers: the step's GPU time."""
    gemm_us = sum(row_us(rows, gemm_into_residual(name)) if name in RESIDUAL_GEMMS else row_us(rows, f"gemm {name}")
                  for name in GEMMS)
    other_us = 2 * row_us(rows, "rms_norm (x alone)") + row_us(rows, ROTARY_STORE) + row_us(rows, "silu_and_mul") + \
        row_us(rows, ENGINE_ATTENTION)
    step_ms = LAYERS * (gemm_us + other_us) / 1e3
    return {"tokens": tokens, "layer_gemm_us": gemm_us, "layer_other_us": other_us, "step_ms": step_ms,
            "gemm_share": gemm_us / (gemm_us + other_us), "prompts_per_s": tokens / PROMPT_LEN / (step_ms / 1e3)}


def row_us(rows: list[dict[str, Any]], name: str) -> float:
    """The time of the row named `name` exactly, or `name` and its shapes (`gemm qkv [..]x[..]`): not of a
    row whose name merely starts with it, as "gemm gate_up, then the engine's attention" does."""
    return next(r["us"] for r in rows if r["kernel"] == name or r["kernel"].startswith(f"{name} ["))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=None, help="tokens of the step (default 8192; quick 1024)")
    parser.add_argument("--quick", action="store_true", help="a step of 1,024 tokens (CI)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: results/<h100|h200>/prefill.json)")
    parser.add_argument("--gemm-variants", action="store_true",
                        help="also time each GEMM with the weight stored transposed and through cuBLASLt")
    parser.add_argument("--gemm-pieces", action="store_true",
                        help="also time the gate/up and down GEMMs cut by rows or columns into pieces")
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (1024 if args.quick else 8192)
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        logger.info("benchmarks/prefill.py times the GPU kernels: CUDA is not available, nothing to do")
        return
    torch.manual_seed(0)
    rows = gemm_rows(args.tokens) + elementwise_rows(args.tokens) + attention_rows(args.tokens) + \
        mixed_attention_rows(args.tokens) + (gemm_variant_rows(args.tokens) if args.gemm_variants else []) + \
        (gemm_piece_rows(args.tokens) if args.gemm_pieces else [])
    summary = layer_summary(rows, args.tokens)
    print_table(rows)
    print_table([summary])
    write_json(args.out or default_out("prefill"),
               {"device": torch.cuda.get_device_name(), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
