"""Benchmark of slora's Triton kernels against the memory roofline (DESIGN §8).

On a CUDA GPU:
- paged decode attention, batch 64 x context 4096 and batch 1 x context 32768 (the split path), 32 query
  / 8 KV heads, head_dim 128, bf16, page_size 16: time and achieved bandwidth (bytes of K, V, query and
  output / time) against the H200's 4.24 TB/s copy bandwidth;
- prefill attention (8 prompts of 1024 tokens): TFLOP/s and the ratio to torch's SDPA on contiguous K/V;
- LoRA shrink + expand for the seven projections of one Llama-3-8B layer (hidden 4096, KV dim 1024,
  intermediate 14336), 64 decode tokens on 64 distinct rank-16 adapters and on one shared adapter:
  time, achieved bandwidth, and the ratio to a loop of per-adapter torch matmuls.

Prints one table and writes JSON (default results/<machine kind>/kernel_bench.json). Without CUDA it stops with
a message, unless --quick, which times the torch references at tiny sizes on the CPU. --lora-sweep times
only the LoRA layer under other launch choices (PDL, 64-token blocks, split partial sums, 16 splits, each
kernel alone); --lora-gemv-sweep the one-token expand against the default one; --decode-sweep decode attention
over bf16 and FP8 caches under other tokens per iteration, warps and stages.

    python benchmarks/kernel_bench.py [--out PATH] [--seed N] [--quick | --lora-sweep | --lora-gemv-sweep |
        --decode-sweep]
"""
import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from common import (
    COPY_BANDWIDTH,
    LLAMA3_8B_MODULES,
    LORA_GROUPS,
    LoraKnobs,
    LoraLayer,
    default_out,
    graph_time_us,
    lora_layer_step,
    time_us,
)
from torch import Tensor

from slora.kernels import reference

if TYPE_CHECKING:                     # the kernels import Triton: the CPU mode (--quick) never loads them
    from slora.kernels.paged_attention import DecodeLaunch


@dataclass
class Row:
    name: str
    config: str
    time_us: float
    graph_time_us: float | None = None     # replayed from a CUDA graph (no launch overhead)
    bytes_moved: int | None = None
    bandwidth_tbs: float | None = None
    roofline_frac: float | None = None     # of COPY_BANDWIDTH
    tflops: float | None = None
    baseline: str | None = None
    baseline_us: float | None = None
    baseline_graph_us: float | None = None
    speedup: float | None = None           # baseline / kernel, eager against eager
    speedup_graph: float | None = None     # the same, both replayed from CUDA graphs
    extra: dict = field(default_factory=dict)


def _bandwidth(row: Row) -> Row:
    best = min(t for t in (row.time_us, row.graph_time_us) if t is not None)
    if row.bytes_moved is not None:
        row.bandwidth_tbs = row.bytes_moved / (best * 1e-6) / 1e12
        row.roofline_frac = row.bandwidth_tbs * 1e12 / COPY_BANDWIDTH
    if row.baseline_us is not None:
        row.speedup = row.baseline_us / row.time_us
    if row.baseline_graph_us is not None and row.graph_time_us is not None:
        row.speedup_graph = row.baseline_graph_us / row.graph_time_us
    return row


# ---------------------------------------------------------------------------------------------------
# Attention


def _random_kv(batch: int, ctx: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """A pool (of `dtype`: float8_e4m3fn for an FP8 cache) with `batch` sequences of `ctx` tokens on randomly
    permuted pages."""
    blocks = math.ceil(ctx / page_size)
    num_pages = batch * blocks + 1
    pool = torch.randn(num_pages, 2 * page_size * kv_heads * head_dim, device="cuda").to(dtype)
    perm = torch.randperm(num_pages - 1, generator=gen).add_(1).to(torch.int32)
    tables = perm[:batch * blocks].view(batch, blocks).cuda()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return pool, tables, lens


def bench_decode(batch: int, ctx: int, gen: torch.Generator, num_splits: int | None = None, *,
                 kv_dtype: torch.dtype = torch.bfloat16, launch: "DecodeLaunch | None" = None) -> Row:
    """Decode attention over a bf16 or FP8 cache (scales of 1.0: the kernel's work does not depend on them);
    `launch`: a DecodeLaunch other than the default."""
    from slora.kernels.paged_attention import (
        _multiprocessors,
        choose_num_splits,
        default_launch,
        paged_attention,
    )
    heads, kv_heads, head_dim, page_size, dtype = 32, 8, 128, 16, torch.bfloat16
    pool, tables, lens = _random_kv(batch, ctx, page_size, kv_heads, head_dim, kv_dtype, gen)
    scales = torch.ones(2, kv_heads, device="cuda") if kv_dtype.itemsize == 1 else None
    query = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
    out = torch.empty_like(query)
    splits = num_splits or choose_num_splits(batch, kv_heads, ctx, _multiprocessors(query.device))
    launch = launch or default_launch(head_dim)

    def run():
        paged_attention(query, pool, tables, lens, page_size, kv_heads, head_dim ** -0.5, kv_scales=scales,
                        num_splits=splits, max_context_len=ctx, out=out, launch=launch)

    run()
    want = reference.paged_attention(query[:2], pool, tables[:2], lens[:2], page_size, kv_heads, head_dim ** -0.5,
                                     kv_scales=scales)
    err = (out[:2].float() - want.float()).abs().max().item()
    kv_bytes = batch * ctx * kv_heads * head_dim * 2 * kv_dtype.itemsize
    io_bytes = 2 * query.numel() * dtype.itemsize + tables.numel() * 4
    cache = "fp8" if scales is not None else "bf16"
    knobs = f"block {launch.block_n} warps {launch.num_warps} stages {launch.num_stages}"
    return _bandwidth(Row("paged_attention decode", f"batch {batch} ctx {ctx} 32q/8kv hd128 {cache} ps16 "
                          f"splits {splits} {knobs}", time_us(run), graph_time_us(run), kv_bytes + io_bytes,
                          extra={"num_splits": splits, "max_abs_err_vs_reference": err, "cache": cache,
                                 **asdict(launch)}))


def decode_sweep(gen: torch.Generator) -> list[Row]:
    """Decode attention at batch 64 x 4,096 tokens (unsplit) and batch 8 x 16,384 (split), a bf16 and an FP8
    cache, under other launch choices: a 1-byte cache reads half the bytes a loop iteration, so it may want
    more tokens an iteration or more stages than a 2-byte one."""
    from slora.kernels.paged_attention import DecodeLaunch

    launches = [DecodeLaunch(block_n=n, num_warps=w, num_stages=st)
                for n in (32, 64, 128) for w, st in ((4, 3), (4, 4), (8, 3))]
    return [bench_decode(batch, ctx, gen, kv_dtype=dtype, launch=launch)
            for batch, ctx in ((64, 4096), (8, 16384))
            for dtype in (torch.bfloat16, torch.float8_e4m3fn) for launch in launches]


def bench_prefill(num_seqs: int, seq_len: int, gen: torch.Generator) -> Row:
    from slora.kernels.prefill_attention import prefill_attention
    heads, kv_heads, head_dim, page_size, dtype = 32, 8, 128, 16, torch.bfloat16
    pool, tables, lens = _random_kv(num_seqs, seq_len, page_size, kv_heads, head_dim, dtype, gen)
    query = torch.randn(num_seqs * seq_len, heads, head_dim, device="cuda", dtype=dtype)
    start_loc = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * seq_len
    out = torch.empty_like(query)

    def run():
        prefill_attention(query, pool, tables, start_loc, lens, page_size, kv_heads, head_dim ** -0.5, out=out)

    # Baseline: torch SDPA (flash) on the same K/V gathered into contiguous tensors.
    pages = reference.kv_page_view(pool, page_size, kv_heads)[tables.long()]      # [b, blocks, 2, ps, kvh, hd]
    k = pages[:, :, 0].reshape(num_seqs, -1, kv_heads, head_dim)[:, :seq_len].transpose(1, 2).contiguous()
    v = pages[:, :, 1].reshape(num_seqs, -1, kv_heads, head_dim)[:, :seq_len].transpose(1, 2).contiguous()
    q = query.view(num_seqs, seq_len, heads, head_dim).transpose(1, 2).contiguous()
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    flops = 4 * num_seqs * heads * head_dim * seq_len * (seq_len + 1) / 2
    t = time_us(run)
    row = _bandwidth(Row("prefill_attention", f"{num_seqs} x {seq_len} new tokens 32q/8kv hd128 bf16 ps16", t,
                         baseline="torch SDPA, contiguous K/V", baseline_us=time_us(sdpa)))
    row.tflops = flops / (t * 1e-6) / 1e12
    return row


# ---------------------------------------------------------------------------------------------------
# LoRA


def bench_lora(num_adapters: int, tokens: int, rank: int, gen: torch.Generator, *, knobs: LoraKnobs = LoraKnobs(),
               baseline: bool = True, table_slots: int | None = None) -> Row:
    """knobs: launch choices other than the wrappers' (the sweeps); baseline: time the torch loop.
    table_slots: adapter slots in the tables (a decode graph has one per sequence however many are used)."""
    step = lora_layer_step(num_adapters, tokens, rank, gen, knobs, table_slots)
    layer, slots, inputs = step.layer, step.slots, step.inputs
    outs = {name: torch.randn(tokens, fout, device="cuda", dtype=torch.bfloat16) for name, _, fout in LLAMA3_8B_MODULES}
    token_ids = [torch.nonzero(slots == a).flatten() for a in range(num_adapters)]

    def torch_loop():
        for name, fin, _ in LLAMA3_8B_MODULES:
            x, out = inputs[fin], outs[name]
            for a, idx in enumerate(token_ids):
                lora_a, lora_bt = layer.dense[a][name]
                out.index_add_(0, idx, (x[idx] @ lora_a.T) @ lora_bt, alpha=2.0)

    err = _check_lora(layer, slots, inputs, rank, step.shrink)
    itemsize = torch.bfloat16.itemsize
    weight_bytes = num_adapters * sum(rank * (fin + fout) for _, fin, fout in LLAMA3_8B_MODULES) * itemsize
    act_bytes = sum(tokens * (fin + 2 * fout + 2 * rank) for _, fin, fout in LLAMA3_8B_MODULES) * itemsize
    config = f"{tokens} tokens, {num_adapters} adapter(s) rank {rank}, {step.num_slots} slots, Llama-3-8B layer bf16"
    if not baseline:
        return _bandwidth(Row("lora 7 modules, sweep", f"{config}, {knobs}", time_us(step.run),
                              graph_time_us(step.run), weight_bytes + act_bytes))
    return _bandwidth(Row("lora shrink+expand, 7 modules (4 launch pairs)", f"{config}, {knobs}", time_us(step.run),
                          graph_time_us(step.run), weight_bytes + act_bytes,
                          baseline="per-adapter torch matmul loop", baseline_us=time_us(torch_loop),
                          baseline_graph_us=graph_time_us(torch_loop),
                          extra={"max_abs_err_vs_reference_q_proj": err, "weight_bytes": weight_bytes}))


def lora_sweep(gen: torch.Generator) -> list[Row]:
    """The LoRA layer at 1 and 64 adapters over 64 table slots (a decode graph's), under other launch
    choices than the wrappers': programmatic dependent launch, 64-token blocks, which shrink and its
    splits, and each kind of kernel timed alone."""
    from slora.kernels.pdl import pdl_supported
    with_pdl = [LoraKnobs(pdl=True)] if pdl_supported(torch.device("cuda")) else []
    knobs = [LoraKnobs(), *with_pdl, LoraKnobs(block_m=64), LoraKnobs(part="shrink"), LoraKnobs(part="expand"),
             LoraKnobs(accumulate=False), LoraKnobs(split_k=16)]
    return [bench_lora(adapters, 64, 16, gen, knobs=k, baseline=False, table_slots=64)
            for adapters in (1, 64) for k in knobs]


def lora_gemv_sweep(gen: torch.Generator) -> list[Row]:
    """The layer's LoRA with the one-token expand kernel against the default one, with PDL as the engine
    launches them: one shared adapter over 4 table slots (a few-adapter decode graph), 64 / 128 / 256
    distinct adapters, and 5 or 32 adapters over 256 slots (a full decode graph replayed with fewer
    adapters); at 64 / 128 / 256 distinct also each group's expand alone."""
    knobs = [LoraKnobs(pdl=True), LoraKnobs(pdl=True, expand_gemv=True), LoraKnobs(part="expand", pdl=True),
             LoraKnobs(part="expand", pdl=True, expand_gemv=True), LoraKnobs(part="shrink", pdl=True)]
    cases = ((1, 64, 4), (64, 64, 64), (128, 128, 128), (256, 256, 256), (5, 256, 256), (32, 256, 256))
    rows = [bench_lora(adapters, tokens, 16, gen, knobs=k, baseline=False, table_slots=slots)
            for adapters, tokens, slots in cases for k in knobs]
    per_group = [LoraKnobs(part="expand", pdl=True, expand_gemv=gemv, group=group)
                 for group in range(len(LORA_GROUPS)) for gemv in (False, True)]
    return rows + [bench_lora(n, n, 16, gen, knobs=k, baseline=False, table_slots=n)
                   for n in (64, 128, 256) for k in per_group]


def _check_lora(layer: LoraLayer, slots: Tensor, inputs: dict[int, Tensor], rank: int,
                shrink: Callable[[Tensor, Tensor, Tensor], Tensor]) -> float:
    """Max error of the timed shrink (its h, partial sums added up) for q_proj against the reference."""
    a_off, _ = layer.offsets["q_proj"]
    h = shrink(inputs[4096], layer.ranks, a_off)
    got = h.sum(dim=0) if h.dim() == 3 else h.clone()
    want = reference.lora_shrink(inputs[4096].float(), layer.pool.float(), slots, layer.page_tables, layer.ranks,
                                 a_off, rank)
    return (got.float() - want).abs().max().item()


# ---------------------------------------------------------------------------------------------------
# CPU quick mode and output


def quick_cpu(gen: torch.Generator) -> list[Row]:
    """Tiny sizes through the torch references, to check the script end to end without a GPU."""
    rows = []
    pool = torch.randn(65, 2 * 16 * 2 * 64, generator=gen)
    tables = (torch.randperm(64, generator=gen) + 1).view(4, 16).to(torch.int32)
    lens = torch.tensor([256, 100, 17, 1], dtype=torch.int32)
    query = torch.randn(4, 8, 64, generator=gen)
    t0 = time.perf_counter()
    reference.paged_attention(query, pool, tables, lens, 16, 2, 0.125)
    rows.append(Row("reference paged_attention (CPU)", "batch 4 ctx<=256 8q/2kv hd64 fp32",
                    (time.perf_counter() - t0) * 1e6))
    x = torch.randn(8, 128, generator=gen)
    lora_pool = torch.randn(16, 1024, generator=gen)
    t0 = time.perf_counter()
    reference.lora_shrink(x, lora_pool, torch.arange(8, dtype=torch.int32) % 2, torch.arange(16).view(2, 8),
                          torch.tensor([4, 8]), torch.tensor([0, 2048]), 8)
    rows.append(Row("reference lora_shrink (CPU)", "8 tokens in 128 ranks 4/8 fp32", (time.perf_counter() - t0) * 1e6))
    return rows


def _fmt(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))


def print_table(rows: list[Row]) -> None:
    header = f"{'kernel':32} {'config':62} {'time us':>9} {'graph us':>9} {'TB/s':>6} {'%peak':>6} " \
             f"{'TFLOP/s':>8} {'base us':>9} {'base gr':>9} {'speedup':>8} {'sp graph':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        frac = None if r.roofline_frac is None else 100 * r.roofline_frac
        print(f"{r.name:32} {r.config:62} {_fmt(r.time_us, '9.1f')} {_fmt(r.graph_time_us, '9.1f')} "
              f"{_fmt(r.bandwidth_tbs, '6.2f')} {_fmt(frac, '6.1f')} {_fmt(r.tflops, '8.1f')} "
              f"{_fmt(r.baseline_us, '9.1f')} {_fmt(r.baseline_graph_us, '9.1f')} {_fmt(r.speedup, '8.2f')} "
              f"{_fmt(r.speedup_graph, '8.2f')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None,
                        help="JSON file (default: results/<cpu|h100|h200>/kernel_bench.json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes through the torch references on the CPU (checks the script, no GPU)")
    parser.add_argument("--lora-sweep", action="store_true", help="only the LoRA layer, under other launch choices")
    parser.add_argument("--lora-gemv-sweep", action="store_true",
                        help="only the LoRA layer: the one-token expand kernel against the default one")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="only decode attention, bf16 and FP8 caches, under other launch choices")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    if args.quick:
        rows, device = quick_cpu(gen), platform.processor() or "cpu"
    elif not torch.cuda.is_available():
        print("benchmarks/kernel_bench.py: CUDA is not available; the Triton kernels are benchmarked on a GPU only. "
              "Use --quick for a tiny CPU run of the torch references.")
        return 0
    elif args.lora_sweep:
        rows, device = lora_sweep(gen), torch.cuda.get_device_name()
    elif args.lora_gemv_sweep:
        rows, device = lora_gemv_sweep(gen), torch.cuda.get_device_name()
    elif args.decode_sweep:
        rows, device = decode_sweep(gen), torch.cuda.get_device_name()
    else:
        device = torch.cuda.get_device_name()
        rows = [bench_decode(64, 4096, gen), bench_decode(64, 4096, gen, num_splits=4),
                bench_decode(64, 4096, gen, kv_dtype=torch.float8_e4m3fn),
                bench_decode(1, 32768, gen), bench_decode(1, 32768, gen, num_splits=1),
                bench_prefill(8, 1024, gen),
                bench_lora(64, 64, 16, gen), bench_lora(64, 64, 16, gen, knobs=LoraKnobs(expand_gemv=True)),
                bench_lora(1, 64, 16, gen), bench_lora(1, 64, 16, gen, table_slots=64),
                bench_lora(64, 64, 16, gen, knobs=LoraKnobs(accumulate=False)),
                bench_lora(1, 64, 16, gen, knobs=LoraKnobs(accumulate=False), table_slots=64)]
    print(f"device: {device}; bandwidth reference {COPY_BANDWIDTH / 1e12:.2f} TB/s (a copy's read+write rate, so "
          "pure reads can exceed it); TB/s uses the faster of eager and graph time")
    print_table(rows)
    out = Path(args.out) if args.out else default_out("kernel_bench", "cpu" if args.quick else "cuda")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "seed": args.seed, "peak_bandwidth_bytes_per_s": COPY_BANDWIDTH,
                               "torch": torch.__version__, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
