"""Triton causal attention of new tokens over a paged cache that may already hold a prefix (DESIGN §4).

Same signature and semantics as `slora.kernels.reference.prefill_attention`, plus optional keyword
arguments. Design:

- The new tokens of all sequences are packed (`query_start_loc`); the grid is (query block, head).
  Query block `i` belongs to the sequence `s` with the largest `query_start_loc[s] // BLOCK_M + s <= i`,
  found by binary search inside the kernel. That numbering leaves a few empty blocks (they exit at
  once) but its size `total_tokens // BLOCK_M + num_seqs` is known on the host without reading device
  memory, so prefill of many sequences of different lengths is one launch, capturable in a graph.
- Each program keeps an online softmax over the keys of its sequence up to its last query position
  (prefix + new tokens, read through the block table) and applies the causal mask only on the
  diagonal blocks.
- With `new_kv` (the caller's own keys and values of the new tokens, e.g. column slices of a fused q/k/v
  output) a kernel of its own reads the queries and the new tokens' keys and values through tensor
  descriptors (TMA on Hopper: a block of rows of one head per copy, no per-element addresses), and only
  the cached prefix through the block table: the pages of one sequence lie anywhere in a pool of many
  gigabytes. Its programs run the query blocks last to first, so the blocks that see the most keys start
  first and the short ones fill the tail.
- Pages are addressed by the pool's page stride and V by its K/V stride (`kv_page_view`'s strides), so the
  page view of a layer whose Ks and Vs lie in two halves of its memory is read as a contiguous pool is.
- An FP8 cache (`kv_scales`, `_prefill_kernel` only): K and V tiles are converted to the query's dtype in
  registers, the head's K scale folds into the score scale and its V scale multiplies the accumulated output.
  new_kv is refused with it: the caller's 16-bit new keys would not be the quantized ones that later steps
  read back, so the new tokens are read from the pool like the prefix.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from slora.kernels.checks import check_int_tensors, check_kv_scales, check_one_device, check_query_and_pool
from slora.kernels.reference import kv_page_view

_LOG2E = 1.4426950408889634


class PrefillLaunch(NamedTuple):
    """How the kernel is cut: query tokens and keys per block, warps, pipeline stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# On CUDA: blocks of 64 queries, or 32 when the sequences are short (fewer padded rows); with the new
# tokens' K/V in rows of their own, three stages (faster on the H200: docs/decisions.md).
# default_launch takes row blocks of LONG_BLOCK_M when a step has that many new tokens per sequence.
LONG_BLOCK_M = 64
_LAUNCH = PrefillLaunch(block_m=LONG_BLOCK_M, block_n=64, num_warps=4, num_stages=2)
_SHORT_LAUNCH = _LAUNCH._replace(block_m=32)
# The interpreter pays for every padded row.
_INTERPRETER_LAUNCH = _LAUNCH._replace(block_m=16)


@triton.jit
def _find_sequence(start_loc_ptr, num_seqs, block, BLOCK_M: tl.constexpr):
    # Largest s in [0, num_seqs) with start_loc[s] // BLOCK_M + s <= block (binary search).
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(start_loc_ptr + mid) // BLOCK_M + mid
        if first <= block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _locate(start_loc_ptr, num_seqs, block, BLOCK_M: tl.constexpr):
    # Query block `block`'s sequence, its first new row, its number of new tokens, and the block's first
    # new token; a block before the first sequence (only when query_start_loc[0] > 0) gets q_len and
    # m_first 0, which the caller's `m_first >= q_len` ends.
    seq = _find_sequence(start_loc_ptr, num_seqs, block, BLOCK_M)
    first = tl.maximum(seq, 0)
    q_start = tl.load(start_loc_ptr + first)
    q_len = tl.where(seq < 0, 0, tl.load(start_loc_ptr + first + 1) - q_start)
    m_first = tl.where(seq < 0, 0, (block - (q_start // BLOCK_M + first)) * BLOCK_M)
    return first, q_start, q_len, m_first


@triton.jit
def _update(q, k, v, keep, m_i, l_i, acc, scale_log2, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Online-softmax update of (m_i, l_i, acc) with one block of keys k and values v [BLOCK_N, HEAD_DIM].
    # q: [BLOCK_M, HEAD_DIM]; keep: [BLOCK_M, BLOCK_N] the pairs that count (MASKED only). Every row keeps
    # a key in the first block it sees, so m_i is finite from then on.
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_keys(k_head_ptr, v_head_ptr, bt_row, pos, valid, page_stride, PAGE_SIZE: tl.constexpr,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    # K and V [BLOCK_N, HEAD_DIM] of positions `pos` of one sequence and KV head, through its block table;
    # k_head_ptr, v_head_ptr: that head's K and V in page 0.
    dims = tl.arange(0, HEAD_DIM)
    page = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    base = page * page_stride + (pos % PAGE_SIZE) * (NUM_KV_HEADS * HEAD_DIM)          # [BLOCK_N]
    k = tl.load(k_head_ptr + base[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_head_ptr + base[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def _attend_paged(q, q_pos, k_head_ptr, v_head_ptr, bt_row, start, end, kv_end, page_stride, scale_log2, m_i,
                  l_i, acc, PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Keys start .. end (blocks of BLOCK_N, positions below kv_end) through the block table.
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        k, v = _paged_keys(k_head_ptr, v_head_ptr, bt_row, pos, valid, page_stride, PAGE_SIZE, NUM_KV_HEADS,
                           HEAD_DIM)
        keep = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        m_i, l_i, acc = _update(q, k, v, keep, m_i, l_i, acc, scale_log2, CAUSAL, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _rows(desc, row, head, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    # Rows row .. row + BLOCK of one head [BLOCK, HEAD_DIM] of a [tokens, heads, head_dim] descriptor; rows
    # past the tensor read as zeros.
    return desc.load([row, head, 0]).reshape(BLOCK, HEAD_DIM)


@triton.jit
def _attend_new(q, rows, k_desc, v_desc, kv_head, q_start, q_len, start, end, scale_log2, m_i, l_i, acc,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The sequence's new keys start .. end (blocks of BLOCK_N) from the step's key and value rows; rows:
    # the queries' indices among the new tokens.
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        valid = j < q_len
        k = _rows(k_desc, q_start + j0, kv_head, BLOCK_N, HEAD_DIM)
        v = _rows(v_desc, q_start + j0, kv_head, BLOCK_N, HEAD_DIM)
        if CAUSAL:
            # A diagonal block may run past the sequence into rows of anything (NaN too): p is 0 there,
            # and 0 * NaN is not.
            v = tl.where(valid[:, None], v, 0.0)
        keep = (j[None, :] <= rows[:, None]) & valid[None, :]
        m_i, l_i, acc = _update(q, k, v, keep, m_i, l_i, acc, scale_log2, CAUSAL, DOT_PRECISION)
    return m_i, l_i, acc


# Ints that change from step to step are not specialised (on == 1 or % 16 == 0), nor the tables' alignment
# (a mixed step passes them from its first prefill row on): each new combination would compile the kernel
# again in the middle of serving. Nor the FP8 scales' alignment (a layer's row of the model's scales).
@triton.jit(do_not_specialize=["num_seqs", "stride_btb", "bt_ptr", "start_loc_ptr", "ctx_ptr", "scales_ptr"])
def _prefill_kernel(
    q_ptr, kv_ptr, bt_ptr, start_loc_ptr, ctx_ptr, out_ptr, scales_ptr,
    scale_log2, num_seqs, stride_qt, stride_qh, stride_btb, stride_ot, stride_oh, page_stride, v_offset,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
):
    # page_stride, v_offset: elements from one page to the next and from a page's K to its V. SCALED: an FP8
    # cache, scales_ptr its [2, NUM_KV_HEADS] scales (K's, then V's).
    head = tl.program_id(1)
    seq, q_start, q_len, m_first = _locate(start_loc_ptr, num_seqs, tl.program_id(0), BLOCK_M)
    if m_first >= q_len:
        return   # an empty block, or one before the first sequence
    ctx_len = tl.load(ctx_ptr + seq)
    prefix = ctx_len - q_len

    rows = m_first + tl.arange(0, BLOCK_M)              # index among the sequence's new tokens
    row_mask = rows < q_len
    q_pos = prefix + rows                               # position in the sequence
    dims = tl.arange(0, HEAD_DIM)
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)      # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    kv_head = head // GROUP
    k_head_ptr = kv_ptr + kv_head * HEAD_DIM
    v_head_ptr = k_head_ptr + v_offset
    score_scale = scale_log2
    if SCALED:
        score_scale = scale_log2 * tl.load(scales_ptr + kv_head)
    kv_end = tl.minimum(prefix + m_first + BLOCK_M, ctx_len)   # one past the block's last query position
    # Keys before the block's first query position need no causal mask; the rest (the diagonal) do.
    unmasked_end = (prefix + m_first) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend_paged(q, q_pos, k_head_ptr, v_head_ptr, bt_row, 0, unmasked_end, kv_end, page_stride,
                                  score_scale, m_i, l_i, acc, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N,
                                  False, DOT_PRECISION)
    m_i, l_i, acc = _attend_paged(q, q_pos, k_head_ptr, v_head_ptr, bt_row, unmasked_end, kv_end, kv_end,
                                  page_stride, score_scale, m_i, l_i, acc, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                  BLOCK_N, True, DOT_PRECISION)
    if SCALED:
        acc = acc * tl.load(scales_ptr + NUM_KV_HEADS + kv_head)   # attention is linear in V
    _store_rows(out_ptr, tokens, head, acc, l_i, row_mask, stride_ot, stride_oh, HEAD_DIM)


@triton.jit
def _store_rows(out_ptr, tokens, head, acc, l_i, row_mask, stride_ot, stride_oh, HEAD_DIM: tl.constexpr):
    # The block's rows of the sequence only: the rows past it belong to the next sequence or the caller.
    dims = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit(do_not_specialize=["num_seqs", "stride_btb", "bt_ptr", "start_loc_ptr", "ctx_ptr"])
def _prefill_new_kv_kernel(
    q_desc, k_desc, v_desc, kv_ptr, bt_ptr, start_loc_ptr, ctx_ptr, out_ptr,
    scale_log2, num_seqs, stride_btb, stride_ot, stride_oh, page_stride, v_offset,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.num_programs(0) - 1 - tl.program_id(0)   # last blocks (most keys) first
    head = tl.program_id(1)
    seq, q_start, q_len, m_first = _locate(start_loc_ptr, num_seqs, block, BLOCK_M)
    if m_first >= q_len:
        return
    prefix = tl.load(ctx_ptr + seq) - q_len

    rows = m_first + tl.arange(0, BLOCK_M)
    q = _rows(q_desc, q_start + m_first, head, BLOCK_M, HEAD_DIM)   # rows past the sequence: never stored
    kv_head = head // GROUP
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # The cached prefix through the block table (every query follows it: only its end is masked), then the
    # step's own keys from its key and value rows, the causal mask on the diagonal only.
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    k_head_ptr = kv_ptr + kv_head * HEAD_DIM
    m_i, l_i, acc = _attend_paged(q, prefix + rows, k_head_ptr, k_head_ptr + v_offset, bt_row, 0, prefix, prefix,
                                  page_stride, scale_log2, m_i, l_i, acc, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                  BLOCK_N, True, DOT_PRECISION)
    diagonal = m_first // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend_new(q, rows, k_desc, v_desc, kv_head, q_start, q_len, 0, diagonal, scale_log2,
                                m_i, l_i, acc, HEAD_DIM, BLOCK_N, False, DOT_PRECISION)
    m_i, l_i, acc = _attend_new(q, rows, k_desc, v_desc, kv_head, q_start, q_len, diagonal,
                                tl.minimum(m_first + BLOCK_M, q_len), scale_log2, m_i, l_i, acc, HEAD_DIM,
                                BLOCK_N, True, DOT_PRECISION)
    _store_rows(out_ptr, (q_start + rows).to(tl.int64), head, acc, l_i, rows < q_len, stride_ot, stride_oh,
                HEAD_DIM)


def _check_inputs(query: Tensor, kv_pool: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                  context_lens: Tensor, page_size: int, num_kv_heads: int, kv_scales: Tensor | None) -> None:
    check_query_and_pool(query, kv_pool, page_size, num_kv_heads, "total_new_tokens")
    check_kv_scales(kv_pool, kv_scales, num_kv_heads)
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if num_seqs < 0:
        raise ValueError(f"context_lens must be [num_seqs], got shape {tuple(context_lens.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], "
                         f"got shape {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], "
                         f"got shape {tuple(block_tables.shape)}")
    check_int_tensors(block_tables=block_tables, query_start_loc=query_start_loc, context_lens=context_lens)
    check_one_device(query=query, kv_pool=kv_pool, block_tables=block_tables, query_start_loc=query_start_loc,
                     context_lens=context_lens)
    if not (query_start_loc.is_contiguous() and context_lens.is_contiguous()):
        raise ValueError("query_start_loc and context_lens must be contiguous")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its rows (stride 1)")


def _check_launch(launch: PrefillLaunch) -> None:
    for name in ("block_m", "block_n", "num_warps"):
        value = getattr(launch, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"launch.{name} must be a power of two, got {value}")
    if launch.num_stages < 1:
        raise ValueError(f"launch.num_stages must be >= 1, got {launch.num_stages}")
    if min(launch.block_m, launch.block_n) < 16:
        raise ValueError(f"launch blocks must be >= 16 (tl.dot), got {launch.block_m} x {launch.block_n}")


def default_launch(query: Tensor, num_seqs: int, new_kv: bool = False) -> PrefillLaunch:
    """The launch for `query.shape[0]` new tokens over `num_seqs` sequences on query's device (new_kv: their
    K/V read from tensors of their own)."""
    if query.device.type != "cuda":
        return _INTERPRETER_LAUNCH
    launch = _LAUNCH if query.shape[0] >= _LAUNCH.block_m * num_seqs else _SHORT_LAUNCH
    if new_kv:
        launch = launch._replace(num_stages=3)
    return launch if query.shape[2] <= 128 else launch._replace(block_n=32)


def _check_new_kv(query: Tensor, kv_pool: Tensor, num_kv_heads: int, key: Tensor, value: Tensor) -> None:
    if kv_pool.dtype == torch.float8_e4m3fn:
        raise ValueError("new_kv cannot go with an FP8 kv_pool: the new tokens' keys and values must be read "
                         "back from the pool, quantized as later steps will read them (omit new_kv)")
    want = (query.shape[0], num_kv_heads, query.shape[2])
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != want:
            raise ValueError(f"{name} must be [total_new_tokens, num_kv_heads, head_dim] = {list(want)}, "
                             f"got {list(tensor.shape)}")
        if tensor.dtype != kv_pool.dtype or tensor.device != query.device or tensor.stride(2) != 1:
            raise ValueError(f"{name} must have kv_pool's dtype, query's device and stride 1 in head_dim")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_descriptor_layout(name, tensor)


def _check_descriptor_layout(name: str, tensor: Tensor) -> None:
    # A tensor descriptor (TMA) needs a 16-byte aligned start and strides of whole 16-byte units.
    size = tensor.element_size()
    if tensor.data_ptr() % 16 or any(stride * size % 16 for stride in tensor.stride()[:2]):
        raise ValueError(f"with new_kv, {name} must start 16-byte aligned and have token and head strides of "
                         f"multiples of 16 bytes, got strides {tuple(tensor.stride())} of {size}-byte elements")


def _rows_descriptor(tensor: Tensor, block: int) -> TensorDescriptor:
    """`[tokens, heads, head_dim]` read `block` rows of one head at a time."""
    return TensorDescriptor.from_tensor(tensor, [block, 1, tensor.shape[2]])


def prefill_attention(query: Tensor, kv_pool: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                      context_lens: Tensor, page_size: int, num_kv_heads: int, scale: float, *,
                      kv_scales: Tensor | None = None, out: Tensor | None = None,
                      launch: PrefillLaunch | None = None, new_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Causal attention of the new tokens of many sequences over a paged cache that may hold a prefix.

    query: `[total_new_tokens, num_heads, head_dim]`, sequence `s` owning rows
    `query_start_loc[s]:query_start_loc[s+1]`, the last tokens of its `context_lens[s]` tokens, whose
    K/V (prefix and new) are already in the cache. Rows before `query_start_loc[0]` or after its last
    entry are not read or written. Returns `[total_new_tokens, num_heads, head_dim]` (written into `out`
    when given). launch: how the kernel is cut (default_launch when None). new_kv: the new tokens' keys and
    values `[total_new_tokens, num_kv_heads, head_dim]` each (the values stored in the cache), read from
    there instead of through the block tables; only a cached prefix is then read from the pool. With it,
    query, key and value start 16-byte aligned, with token and head strides of whole 16-byte units.

    kv_pool: `[num_pages, page_elems]` contiguous or the page view `[num_pages, 2, page_size, num_kv_heads,
    head_dim]` (`slora.kernels.reference.kv_page_view`) with free page and K/V strides. kv_scales: float32
    `[2, num_kv_heads]` (K's, then V's), given exactly when kv_pool is float8_e4m3fn; new_kv is refused then."""
    _check_inputs(query, kv_pool, block_tables, query_start_loc, context_lens, page_size, num_kv_heads, kv_scales)
    if launch is not None:
        _check_launch(launch)
    if new_kv is not None:
        _check_new_kv(query, kv_pool, num_kv_heads, *new_kv)
    total, num_heads, head_dim = query.shape
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(2) != 1:
        raise ValueError("out must have the shape, dtype and device of query and stride 1 in head_dim")
    num_seqs = context_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out
    launch = launch or default_launch(query, num_seqs, new_kv is not None)
    grid = (total // launch.block_m + num_seqs, num_heads)
    pages = kv_page_view(kv_pool, page_size, num_kv_heads)   # [num_pages, 2, page_size, num_kv_heads, head_dim]
    common = dict(PAGE_SIZE=page_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                  GROUP=num_heads // num_kv_heads, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                  DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
                  num_warps=launch.num_warps, num_stages=launch.num_stages)
    if new_kv is None:
        _prefill_kernel[grid](
            query, pages, block_tables, query_start_loc, context_lens, out,
            out if kv_scales is None else kv_scales,            # unused by the kernel without scales
            scale * _LOG2E, num_seqs, query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0),
            out.stride(1), pages.stride(0), pages.stride(1), SCALED=kv_scales is not None, **common)
    else:
        key, value = new_kv
        _prefill_new_kv_kernel[grid](
            _rows_descriptor(query, launch.block_m), _rows_descriptor(key, launch.block_n),
            _rows_descriptor(value, launch.block_n), pages, block_tables, query_start_loc, context_lens, out,
            scale * _LOG2E, num_seqs, block_tables.stride(0), out.stride(0), out.stride(1), pages.stride(0),
            pages.stride(1), **common)
    return out
