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
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from slora.kernels.checks import check_int_tensors, check_one_device, check_query_and_pool

_LOG2E = 1.4426950408889634
# Launch parameters on CUDA: query tokens and keys per block, warps, pipeline stages.
_BLOCK_M = 64
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 2


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
def _attend_block(q, q_pos, kv_head_ptr, bt_row, n0, kv_end, page_elems, scale_log2, m_i, l_i, acc,
                  PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Online-softmax update of (m_i, l_i, acc) with keys n0 .. n0 + BLOCK_N of one sequence and KV head.
    # q: [BLOCK_M, HEAD_DIM]; q_pos: [BLOCK_M] positions; kv_head_ptr: pool base shifted to the head.
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < kv_end
    dims = tl.arange(0, HEAD_DIM)
    page = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    base = page * page_elems + (pos % PAGE_SIZE) * (NUM_KV_HEADS * HEAD_DIM)          # [BLOCK_N]
    k = tl.load(kv_head_ptr + base[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(kv_head_ptr + base[:, None] + PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM + dims[None, :],
                mask=valid[:, None], other=0.0)                                       # V follows K
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if CAUSAL:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Ints that change from step to step are not specialised (on == 1 or % 16 == 0): each new combination
# would compile the kernel again in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_btb"])
def _prefill_kernel(
    q_ptr, kv_ptr, bt_ptr, start_loc_ptr, ctx_ptr, out_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_btb, stride_ot, stride_oh,
    page_elems,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_sequence(start_loc_ptr, num_seqs, block, BLOCK_M)
    if seq < 0:
        return   # only when query_start_loc[0] > 0: blocks before the first sequence
    q_start = tl.load(start_loc_ptr + seq)
    q_len = tl.load(start_loc_ptr + seq + 1) - q_start
    m_first = (block - (q_start // BLOCK_M + seq)) * BLOCK_M   # first new token of this block
    if m_first >= q_len:
        return
    ctx_len = tl.load(ctx_ptr + seq)
    prefix = ctx_len - q_len

    rows = m_first + tl.arange(0, BLOCK_M)              # index among the sequence's new tokens
    row_mask = rows < q_len
    q_pos = prefix + rows                               # position in the sequence
    dims = tl.arange(0, HEAD_DIM)
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)      # [BLOCK_M, HEAD_DIM]

    kv_head = head // GROUP
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    kv_head_ptr = kv_ptr + kv_head * HEAD_DIM
    # Keys before the block's first query position need no causal mask; the rest (the diagonal) do.
    unmasked_end = (prefix + m_first) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(prefix + m_first + BLOCK_M, ctx_len)   # one past the block's last query position
    for n0 in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, q_pos, kv_head_ptr, bt_row, n0, kv_end, page_elems, scale_log2,
                                      m_i, l_i, acc, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, False,
                                      DOT_PRECISION)
    for n0 in range(unmasked_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, q_pos, kv_head_ptr, bt_row, n0, kv_end, page_elems, scale_log2,
                                      m_i, l_i, acc, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, True,
                                      DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _check_inputs(query: Tensor, kv_pool: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                  context_lens: Tensor, page_size: int, num_kv_heads: int) -> None:
    check_query_and_pool(query, kv_pool, page_size, num_kv_heads, "total_new_tokens")
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
    if not (kv_pool.is_contiguous() and query_start_loc.is_contiguous() and context_lens.is_contiguous()):
        raise ValueError("kv_pool, query_start_loc and context_lens must be contiguous")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its rows (stride 1)")


def prefill_attention(query: Tensor, kv_pool: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                      context_lens: Tensor, page_size: int, num_kv_heads: int, scale: float, *,
                      out: Tensor | None = None) -> Tensor:
    """Causal attention of the new tokens of many sequences over a paged cache that may hold a prefix.

    query: `[total_new_tokens, num_heads, head_dim]`, sequence `s` owning rows
    `query_start_loc[s]:query_start_loc[s+1]`, the last tokens of its `context_lens[s]` tokens, whose
    K/V (prefix and new) are already in the cache. Returns `[total_new_tokens, num_heads, head_dim]`
    (written into `out` when given)."""
    _check_inputs(query, kv_pool, block_tables, query_start_loc, context_lens, page_size, num_kv_heads)
    total, num_heads, head_dim = query.shape
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(2) != 1:
        raise ValueError("out must have the shape, dtype and device of query and stride 1 in head_dim")
    num_seqs = context_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out
    if query.device.type != "cuda":
        block_m = 16  # the interpreter pays for every padded row
    else:
        block_m = _BLOCK_M if total >= _BLOCK_M * num_seqs else 32
    block_n = _BLOCK_N if head_dim <= 128 else 32
    grid = (total // block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        query, kv_pool, block_tables, query_start_loc, context_lens, out,
        scale * _LOG2E, num_seqs,
        query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        kv_pool.shape[1],
        PAGE_SIZE=page_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    return out
