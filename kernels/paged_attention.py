"""Triton decode attention over the paged KV pool (DESIGN §2, §4).

Same signature and semantics as `slora.kernels.reference.paged_attention`, plus optional keyword
arguments. Design:

- One program per (sequence, KV head, context split). The `group = num_heads // num_kv_heads` query
  heads that share a KV head are processed together as the rows of one `tl.dot`, padded to at least 16
  rows so the matrix units are used, and every K/V tile is read once for the whole group.
- Long contexts or small batches are split over the context (flash-decoding): each split writes its
  normalised partial output and log-sum-exp, and a second kernel merges the splits. Each sequence's
  own length is divided among the splits inside the kernel, so the grid depends only on host ints
  (batch, heads, number of splits): nothing reads device memory on the host, and the launch can be
  captured in a CUDA graph.
- Softmax is computed in base 2 with `scale * log2(e)` folded into the scores.
- A page is addressed by the pool's page stride and its V by the K/V stride (`kv_page_view`'s strides), so
  the page view of a layer whose Ks and Vs lie in two halves of its memory is read as a contiguous pool is.
- An FP8 cache (`kv_scales`): K and V tiles are converted to the query's dtype in registers (exact: every
  E4M3 value is a float16 and a bfloat16); the program's K scale is folded into the score scale and its V
  scale multiplies the normalised output (attention is linear in V), so the merge of splits is unchanged.
- `pdl` (programmatic dependent launch, `slora.kernels.pdl`): the context lengths are read before waiting
  for the previous kernel (the rotary kernel storing the K/V), the query, block tables and pool after.
"""
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from slora.kernels.checks import check_int_tensors, check_kv_scales, check_one_device, check_query_and_pool
from slora.kernels.layout import next_power_of_2
from slora.kernels.pdl import check_pdl_supported, launch_options, pdl_start, pdl_wait
from slora.kernels.reference import kv_page_view

_LOG2E = 1.4426950408889634
# Below this many context tokens per split, the merge costs more than the parallelism brings.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64
# Programs in flight we aim for, per multiprocessor, before splitting stops paying.
_PROGRAMS_PER_SM = 4


@dataclass(frozen=True, kw_only=True)
class DecodeLaunch:
    """How the decode kernel is launched: context tokens a loop iteration reads (a power of two >= 16), warps
    and pipeline stages. The default suits head_dim <= 128 (past it, 32 tokens); `benchmarks/kernel_bench.py
    --decode-sweep` times others."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"num_warps must be a power of two <= 16 and num_stages >= 1, got {self}")


def default_launch(head_dim: int) -> DecodeLaunch:
    return DecodeLaunch() if head_dim <= 128 else DecodeLaunch(block_n=32)


@triton.jit
def _split_chunk(ctx_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    # Tokens each split of a sequence of `ctx_len` tokens handles, a multiple of BLOCK_N (>= BLOCK_N).
    per_split = tl.cdiv(ctx_len, NUM_SPLITS)
    return tl.maximum(tl.cdiv(per_split, BLOCK_N), 1) * BLOCK_N


# The block-table width is not specialised (on == 1 or % 16 == 0): the decode graphs fix it, but the decode
# rows of eager mixed steps bring any width, and each would compile a variant in the middle of serving. Nor
# the alignment of the scales (a layer's row of the model's [layers, 2, kv_heads] scales): two scalar loads.
@triton.jit(do_not_specialize=["stride_btb", "scales_ptr"])
def _paged_decode_kernel(
    q_ptr, kv_ptr, bt_ptr, ctx_ptr, out_ptr, part_out_ptr, part_lse_ptr, scales_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    page_stride, v_offset,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, SCALED: tl.constexpr,
):
    # page_stride, v_offset: elements from one page to the next and from a page's K to its V (int64 products:
    # a layer may hold more than 2**31 elements). SCALED: an FP8 cache, scales_ptr its [2, NUM_KV_HEADS] scales.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pdl_start(USE_PDL)
    ctx_len = tl.load(ctx_ptr + seq)
    pdl_wait(USE_PDL)
    score_scale, v_scale = _kv_head_scales(scales_ptr, kv_head, scale_log2, NUM_KV_HEADS, SCALED)
    chunk = _split_chunk(ctx_len, NUM_SPLITS, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, ctx_len)
    if NUM_SPLITS > 1:  # noqa: SIM102
        if start >= ctx_len:  # nested: the outer test is a constexpr, resolved at compile time
            return  # this sequence is too short to reach this split; the merge skips it

    rows = tl.arange(0, GROUP_PAD)                      # query heads of this KV head (padded)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)      # [GROUP_PAD, HEAD_DIM]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)   # running max (base-2 scores)
    l_i = tl.zeros([GROUP_PAD], tl.float32)                  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    token_stride: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    v_ptr = kv_ptr + v_offset                                # the V of page 0, once, outside the loop
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        base = page * page_stride + (pos % PAGE_SIZE) * token_stride + kv_head * HEAD_DIM   # [BLOCK_N]
        k = tl.load(kv_ptr + base[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + base[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * score_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    # l_i == 0 only for an empty context (a padding row): write zeros, not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SCALED:
        out = out * v_scale
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        # part_out: [batch, num_heads, NUM_SPLITS, HEAD_DIM] fp32; part_lse: [batch, num_heads, NUM_SPLITS]
        lse_idx = (seq * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS + split   # [GROUP_PAD]
        tl.store(part_lse_ptr + lse_idx, m_i + tl.log2(l_i), mask=row_mask)
        tl.store(part_out_ptr + lse_idx[:, None] * HEAD_DIM + dims[None, :], out, mask=row_mask[:, None])


@triton.jit
def _kv_head_scales(scales_ptr, kv_head, scale_log2, NUM_KV_HEADS: tl.constexpr, SCALED: tl.constexpr):
    # (score scale, V scale) of one KV head: with an FP8 cache its K scale folds into the scores' scale.
    if SCALED:
        return scale_log2 * tl.load(scales_ptr + kv_head), tl.load(scales_ptr + NUM_KV_HEADS + kv_head)
    return scale_log2, 1.0


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, ctx_ptr, out_ptr,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program per (sequence, query head): weighted sum of the splits' partial outputs.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    pdl_start(USE_PDL)
    ctx_len = tl.load(ctx_ptr + seq)
    pdl_wait(USE_PDL)
    active = tl.cdiv(ctx_len, _split_chunk(ctx_len, NUM_SPLITS, BLOCK_N))   # splits that wrote
    splits = tl.arange(0, SPLITS_PAD)
    mask = splits < active
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + row, mask=mask, other=float("-inf"))      # [SPLITS_PAD]
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(mask, tl.exp2(lse - m), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=mask[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)   # [HEAD_DIM]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def _check_inputs(query: Tensor, kv_pool: Tensor, block_tables: Tensor, context_lens: Tensor,
                  page_size: int, num_kv_heads: int, kv_scales: Tensor | None) -> None:
    check_query_and_pool(query, kv_pool, page_size, num_kv_heads, "batch")
    check_kv_scales(kv_pool, kv_scales, num_kv_heads)
    batch = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [batch={batch}, max_blocks], got shape {tuple(block_tables.shape)}")
    if context_lens.dim() != 1 or context_lens.shape[0] != batch:
        raise ValueError(f"context_lens must be [batch={batch}], got shape {tuple(context_lens.shape)}")
    check_int_tensors(block_tables=block_tables, context_lens=context_lens)
    check_one_device(query=query, kv_pool=kv_pool, block_tables=block_tables, context_lens=context_lens)
    if not context_lens.is_contiguous() or block_tables.stride(1) != 1:
        raise ValueError("context_lens must be contiguous, block_tables contiguous in its rows")


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one by one: splitting only adds work


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, multiprocessors: int) -> int:
    """Context splits per sequence: none once (sequence, KV head) programs fill the GPU twice over
    (measured on an H200: batch 64 x 8 KV heads reads KV at full bandwidth unsplit); otherwise enough
    programs to fill it, each split >= a few hundred tokens."""
    programs = max(batch * num_kv_heads, 1)
    if programs >= 2 * multiprocessors:
        return 1
    wanted = math.ceil(_PROGRAMS_PER_SM * multiprocessors / programs)
    useful = math.ceil(max(max_context_len, 1) / _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, _MAX_SPLITS))


def paged_attention(query: Tensor, kv_pool: Tensor, block_tables: Tensor, context_lens: Tensor,
                    page_size: int, num_kv_heads: int, scale: float, *, kv_scales: Tensor | None = None,
                    max_context_len: int | None = None, num_splits: int | None = None,
                    out: Tensor | None = None, pdl: bool = False, launch: DecodeLaunch | None = None) -> Tensor:
    """Decode attention: query `[batch, num_heads, head_dim]`, one token per sequence, attending to the
    `context_lens[b]` tokens of `block_tables[b]` (its own token included). Returns `[batch, num_heads,
    head_dim]` (written into `out` when given). A sequence with context length 0 gets zeros. kv_pool:
    `[num_pages, page_elems]` contiguous or the page view `[num_pages, 2, page_size, num_kv_heads, head_dim]`
    (`slora.kernels.reference.kv_page_view`) with free page and K/V strides.

    kv_scales: float32 `[2, num_kv_heads]` (K's, then V's), given exactly when kv_pool is float8_e4m3fn.
    max_context_len: an upper bound on `context_lens` used only to choose the number of splits; defaults
        to `block_tables.shape[1] * page_size`, so the host never reads device memory.
    num_splits: force the number of context splits (1 = no split, no merge kernel).
    pdl: launch with programmatic dependent launch: context_lens is read before waiting for earlier
        kernels, so it must not come from any that may still run (slora.kernels.pdl).
    launch: the decode kernel's launch parameters (default: `default_launch(head_dim)`).
    """
    _check_inputs(query, kv_pool, block_tables, context_lens, page_size, num_kv_heads, kv_scales)
    check_pdl_supported(pdl, query.device)
    batch, num_heads, head_dim = query.shape
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(2) != 1:
        raise ValueError("out must have the shape, dtype and device of query and stride 1 in head_dim")
    if batch == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * page_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, _multiprocessors(query.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = num_heads // num_kv_heads
    launch = launch or default_launch(head_dim)
    block_n = launch.block_n
    if num_splits == 1:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    else:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    pages = kv_page_view(kv_pool, page_size, num_kv_heads)   # [num_pages, 2, page_size, num_kv_heads, head_dim]
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        query, pages, block_tables, context_lens, out, part_out, part_lse,
        out if kv_scales is None else kv_scales,                # unused by the kernel without scales
        scale * _LOG2E,
        query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        pages.stride(0), pages.stride(1),
        PAGE_SIZE=page_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)), BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", USE_PDL=pdl, SCALED=kv_scales is not None,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **launch_options(pdl),
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, context_lens, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            SPLITS_PAD=next_power_of_2(num_splits), BLOCK_N=block_n, USE_PDL=pdl,
            num_warps=4, **launch_options(pdl),
        )
    return out
