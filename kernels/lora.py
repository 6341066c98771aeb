"""Triton multi-LoRA shrink (`x @ Aᵀ`) and expand (`h @ Bᵀ`, added into the base output) over the
unified page pool (DESIGN §2, §4).

Same signatures and semantics as `lora_shrink` / `lora_expand` in `slora.kernels.reference`, plus
optional keyword arguments. Design (segmented gather matmul, SGMV-style):

- Tokens are grouped by adapter slot: `lora_segments` sorts token indices by slot on the device
  (tokens without adapter, slot -1, sort first and belong to no segment, so they cost nothing). The
  engine can compute the segments once per step and pass them to every call through `segments=`.
- Each program takes a block of up to BLOCK_M tokens of one slot, so an adapter's weights are read
  once per block whether the batch is decode (one token per adapter) or prefill (long segments), and
  the product runs on `tl.dot`. Block `i` belongs to the slot `s` with the largest
  `seg_starts[s] // BLOCK_M + s <= i` (binary search in the kernel); that numbering needs only
  `tokens // BLOCK_M + slots` programs along the grid's first axis, a host int, so nothing is read back.
- Heterogeneous ranks: shrink splits the rank into BLOCK_R-row blocks, and programs past their
  slot's rank exit; expand loops over the slot's real rank. Rows past the rank are never read.
- A and Bᵀ are read through the slot's page table: element `e` of the logical buffer is
  `pool[page_table[e // page_elems], e % page_elems]`, rows of an `n`-wide matrix start `align_up(n)`
  apart. Tiles are at most ALIGN wide along a row and start at multiples of their width, so each tile
  row lies in one page and needs one page-table lookup.
- Shrink of few tokens splits the reduction (`in_features`) over SPLIT_K programs that write fp32
  partial sums, summed afterwards in a fixed order (deterministic, no atomics).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from slora.kernels.layout import ALIGN, align_up

# Programs in flight we aim for, per multiprocessor, before splitting the shrink reduction stops paying.
_PROGRAMS_PER_SM = 2
# Each split of the shrink reduction covers at least this many input features.
_MIN_K_PER_SPLIT = 512


class LoraSegments(NamedTuple):
    """Tokens grouped by adapter slot, computed on the device (no host synchronisation).

    token_order: int32 [tokens], token indices sorted by slot (slot -1 first, stable).
    seg_starts: int32 [num_slots + 1]; the tokens of slot `s` are
        `token_order[seg_starts[s]:seg_starts[s + 1]]`."""
    token_order: Tensor
    seg_starts: Tensor


def lora_segments(token_slots: Tensor, num_slots: int) -> LoraSegments:
    """Group the tokens of one step by adapter slot; pass the result to every shrink/expand of the step."""
    if token_slots.dim() != 1 or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be a 1-D int32/int64 tensor, got {token_slots.dtype} "
                         f"of shape {tuple(token_slots.shape)}")
    sorted_slots, order = torch.sort(token_slots, stable=True)
    bounds = torch.arange(num_slots + 1, dtype=sorted_slots.dtype, device=token_slots.device)
    starts = torch.searchsorted(sorted_slots, bounds)
    return LoraSegments(order.to(torch.int32), starts.to(torch.int32))


@triton.jit
def _find_slot(seg_ptr, num_slots, block, BLOCK_M: tl.constexpr):
    # Largest s in [0, num_slots) with seg_starts[s] // BLOCK_M + s <= block (binary search).
    lo = 0
    hi = num_slots
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(seg_ptr + mid) // BLOCK_M + mid
        if first <= block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _segment_rows(seg_ptr, order_ptr, slot, block, BLOCK_M: tl.constexpr):
    # Token indices [BLOCK_M] of this block of the slot's segment, their mask, and whether any is valid.
    seg_lo = tl.load(seg_ptr + slot)
    seg_hi = tl.load(seg_ptr + slot + 1)
    first = seg_lo + (block - (seg_lo // BLOCK_M + slot)) * BLOCK_M
    idx = first + tl.arange(0, BLOCK_M)
    row_mask = idx < seg_hi
    tokens = tl.load(order_ptr + idx, mask=row_mask, other=0).to(tl.int64)
    return tokens, row_mask, first < seg_hi


@triton.jit
def _row_tile_addresses(pt_row, offset, rows, row_stride, col0, page_elems):
    # Pool element index of column col0 of each row of a paged matrix (int64 [len(rows)]); a tile of
    # <= ALIGN columns from there stays in that page.
    elem = offset + rows.to(tl.int64) * row_stride + col0
    page = tl.load(pt_row + elem // page_elems).to(tl.int64)
    return page * page_elems + elem % page_elems


@triton.jit
def _lora_shrink_kernel(
    x_ptr, pool_ptr, order_ptr, seg_ptr, pt_ptr, ranks_ptr, a_off_ptr, h_ptr,
    num_slots, in_features, row_stride, max_rank, page_elems, k_per_split,
    stride_xt, stride_pt, stride_hsplit, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # h[split, token, r] = sum over this split's k of x[token, k] * A_slot[r, k], for one block of
    # BLOCK_M tokens of one slot and BLOCK_R rank rows. x: [T, in]; h: [splits, T, max_rank].
    block = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R
    split = tl.program_id(2)
    slot = _find_slot(seg_ptr, num_slots, block, BLOCK_M)
    rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)
    if r0 >= rank:
        return   # past this slot's rank (or rank 0): no work, nothing read
    tokens, row_mask, any_row = _segment_rows(seg_ptr, order_ptr, slot, block, BLOCK_M)
    if not any_row:
        return
    ranks_idx = r0 + tl.arange(0, BLOCK_R)
    r_mask = ranks_idx < rank
    rows_in = tl.where(r_mask, ranks_idx, 0)                 # clamp: masked rows read row 0's page entry
    a_offset = tl.load(a_off_ptr + slot)
    pt_row = pt_ptr + slot.to(tl.int64) * stride_pt
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens * stride_xt                       # [BLOCK_M] row pointers
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = k0 + cols < in_features
        x = tl.load(x_rows[:, None] + k0 + cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_base = _row_tile_addresses(pt_row, a_offset, rows_in, row_stride, k0, page_elems)   # [BLOCK_R]
        a = tl.load(pool_ptr + a_base[:, None] + cols[None, :], mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0)                                 # [BLOCK_R, BLOCK_K]
        acc += tl.dot(x, tl.trans(a.to(x.dtype)), input_precision=DOT_PRECISION)
    h_ptrs = h_ptr + split * stride_hsplit + tokens[:, None] * stride_ht + ranks_idx[None, :]
    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    h_ptr, pool_ptr, order_ptr, seg_ptr, pt_ptr, ranks_ptr, b_off_ptr, scale_ptr, out_ptr,
    num_slots, out_features, row_stride, h_cols, page_elems,
    stride_ht, stride_pt, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # out[token, n] += scaling_slot * sum over r < rank of h[token, r] * Bᵀ_slot[r, n], for one block of
    # BLOCK_M tokens of one slot and N_TILES * BLOCK_N output columns. h: [T, h_cols]; out: [T, out].
    block = tl.program_id(0)
    slot = _find_slot(seg_ptr, num_slots, block, BLOCK_M)
    rank = tl.minimum(tl.load(ranks_ptr + slot), h_cols)
    if rank <= 0:
        return
    tokens, row_mask, any_row = _segment_rows(seg_ptr, order_ptr, slot, block, BLOCK_M)
    if not any_row:
        return
    b_offset = tl.load(b_off_ptr + slot)
    scaling = tl.load(scale_ptr + slot).to(tl.float32)
    pt_row = pt_ptr + slot.to(tl.int64) * stride_pt
    cols = tl.arange(0, BLOCK_N)
    h_rows = h_ptr + tokens * stride_ht
    out_rows = out_ptr + tokens * stride_ot
    for tile in range(N_TILES):
        n0 = (tl.program_id(1) * N_TILES + tile) * BLOCK_N
        n_mask = n0 + cols < out_features
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            ranks_idx = r0 + tl.arange(0, BLOCK_R)
            r_mask = ranks_idx < rank
            h = tl.load(h_rows[:, None] + ranks_idx[None, :], mask=row_mask[:, None] & r_mask[None, :],
                        other=0.0)                              # [BLOCK_M, BLOCK_R]
            b_base = _row_tile_addresses(pt_row, b_offset, tl.where(r_mask, ranks_idx, 0), row_stride, n0,
                                         page_elems)           # [BLOCK_R]
            b = tl.load(pool_ptr + b_base[:, None] + cols[None, :], mask=r_mask[:, None] & n_mask[None, :],
                        other=0.0)                              # [BLOCK_R, BLOCK_N]
            acc += tl.dot(h, b.to(h.dtype), input_precision=DOT_PRECISION)
        o_ptrs = out_rows[:, None] + n0 + cols[None, :]
        o_mask = row_mask[:, None] & n_mask[None, :]
        base = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, (base + acc * scaling).to(out_ptr.dtype.element_ty), mask=o_mask)


# ----------------------------------------------------------------------------------------------------
# Wrappers


def _check_common(name: str, act: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                  ranks: Tensor, offsets: Tensor) -> None:
    """Checks shared by shrink and expand; `act` is the [tokens, features] activation (x or out)."""
    if act.dim() != 2:
        raise ValueError(f"{name} must be [tokens, features], got shape {tuple(act.shape)}")
    if act.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {act.dtype}")
    if act.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1)")
    if pool.dim() != 2 or not pool.is_floating_point():
        raise ValueError(f"pool must be a floating-point [num_pages, page_elems] tensor, got {pool.dtype} "
                         f"of shape {tuple(pool.shape)}")
    if pool.shape[1] % ALIGN != 0:
        raise ValueError(f"pool page_elems {pool.shape[1]} must be a multiple of ALIGN={ALIGN}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    if token_slots.dim() != 1 or token_slots.shape[0] != act.shape[0]:
        raise ValueError(f"token_slots must be [tokens={act.shape[0]}], got shape {tuple(token_slots.shape)}")
    if page_tables.dim() != 2 or page_tables.stride(1) != 1:
        raise ValueError(f"page_tables must be [slots, max_pages] with stride 1 in its rows, "
                         f"got shape {tuple(page_tables.shape)}")
    num_slots = page_tables.shape[0]
    for label, t in (("token_slots", token_slots), ("page_tables", page_tables), ("ranks", ranks),
                     ("offsets", offsets)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{label} must be int32 or int64, got {t.dtype}")
    for label, t in (("ranks", ranks), ("offsets", offsets)):
        if t.dim() != 1 or t.shape[0] != num_slots or not t.is_contiguous():
            raise ValueError(f"{label} must be a contiguous [slots={num_slots}] tensor, got shape {tuple(t.shape)}")


def _check_devices(*tensors: Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def _check_segments(segments: LoraSegments, num_tokens: int, num_slots: int, device: torch.device) -> None:
    order, starts = segments
    if order.shape != (num_tokens,) or starts.shape != (num_slots + 1,):
        raise ValueError(f"segments must hold token_order [{num_tokens}] and seg_starts [{num_slots + 1}], "
                         f"got {tuple(order.shape)} and {tuple(starts.shape)}")
    if order.dtype != torch.int32 or starts.dtype != torch.int32 or order.device != device or starts.device != device:
        raise ValueError("segments must be int32 tensors on the device of x (use lora_segments)")


def _block_m(num_tokens: int, num_slots: int, device: torch.device) -> int:
    """Tokens per block: 16 (the smallest tl.dot) unless segments are long on average."""
    if device.type == "cuda" and num_tokens >= 64 * max(num_slots, 1):
        return 64
    return 16


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one by one: splitting only adds work


def _choose_split_k(num_blocks: int, rank_blocks: int, in_features: int, device: torch.device) -> int:
    programs = max(num_blocks * rank_blocks, 1)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _multiprocessors(device), programs)
    return max(1, min(wanted, in_features // _MIN_K_PER_SPLIT))


def lora_shrink(x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                a_offsets: Tensor, max_rank: int, *, segments: LoraSegments | None = None,
                split_k: int | None = None) -> Tensor:
    """h[t, :r] = x[t] @ A_sᵀ for s = token_slots[t] of rank r; zero elsewhere. Returns [tokens, max_rank]
    in x's dtype.

    x: [tokens, in_features]; pool: [num_pages, page_elems]; token_slots: [tokens] (-1 = no adapter);
    page_tables: [slots, max_pages]; ranks, a_offsets: [slots] (element offset of A's first row).
    segments: `lora_segments(token_slots, slots)`, computed here when not given.
    split_k: force the number of splits of the reduction over in_features."""
    _check_common("x", x, pool, token_slots, page_tables, ranks, a_offsets)
    _check_devices(x, pool, token_slots, page_tables, ranks, a_offsets)
    if max_rank <= 0:
        raise ValueError(f"max_rank must be positive, got {max_rank}")
    num_tokens, in_features = x.shape
    num_slots = page_tables.shape[0]
    if segments is None:
        segments = lora_segments(token_slots, num_slots)
    _check_segments(segments, num_tokens, num_slots, x.device)
    block_m = _block_m(num_tokens, num_slots, x.device)
    block_r = 16
    num_blocks = num_tokens // block_m + num_slots
    rank_blocks = triton.cdiv(max_rank, block_r)
    if split_k is None:
        split_k = _choose_split_k(min(num_blocks, num_tokens), rank_blocks, in_features, x.device)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    block_k = min(ALIGN, 64)
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)   # no empty splits
    # Rows without adapter and columns past each slot's rank stay zero.
    h = torch.zeros((split_k if split_k > 1 else 1, num_tokens, max_rank),
                    dtype=torch.float32 if split_k > 1 else x.dtype, device=x.device)
    if num_tokens == 0 or num_slots == 0:
        return h[0]
    _lora_shrink_kernel[(num_blocks, rank_blocks, split_k)](
        x, pool, segments.token_order, segments.seg_starts, page_tables, ranks, a_offsets, h,
        num_slots, in_features, align_up(in_features), max_rank, pool.shape[1], k_per_split,
        x.stride(0), page_tables.stride(0), h.stride(0), h.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )
    if split_k > 1:
        return h.sum(dim=0).to(x.dtype)
    return h[0]


def lora_expand(out: Tensor, h: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                ranks: Tensor, b_offsets: Tensor, scalings: Tensor, *,
                segments: LoraSegments | None = None) -> None:
    """out[t] += (h[t, :r] @ Bᵀ_s) * scaling_s for s = token_slots[t]; tokens with slot -1 untouched.

    out: [tokens, out_features] (may be a column slice of a wider output); h: [tokens, >= max rank];
    b_offsets: [slots] element offset of Bᵀ's first row; scalings: [slots] float.
    segments: `lora_segments(token_slots, slots)`, computed here when not given."""
    _check_common("out", out, pool, token_slots, page_tables, ranks, b_offsets)
    if h.dim() != 2 or h.shape[0] != out.shape[0] or h.stride(1) != 1:
        raise ValueError(f"h must be [tokens={out.shape[0]}, max_rank] with stride 1 in its rows, "
                         f"got shape {tuple(h.shape)}")
    if h.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"h must be float16, bfloat16 or float32, got {h.dtype}")
    num_slots = page_tables.shape[0]
    if scalings.dim() != 1 or scalings.shape[0] != num_slots or not scalings.is_floating_point():
        raise ValueError(f"scalings must be a floating-point [slots={num_slots}] tensor, "
                         f"got {scalings.dtype} of shape {tuple(scalings.shape)}")
    _check_devices(out, h, pool, token_slots, page_tables, ranks, b_offsets, scalings)
    num_tokens, out_features = out.shape
    if segments is None:
        segments = lora_segments(token_slots, num_slots)
    _check_segments(segments, num_tokens, num_slots, out.device)
    if num_tokens == 0 or num_slots == 0 or h.shape[1] == 0:
        return
    block_m = _block_m(num_tokens, num_slots, out.device)
    block_n = min(ALIGN, 64)
    n_tiles = 1
    grid = (num_tokens // block_m + num_slots, triton.cdiv(out_features, block_n * n_tiles))
    _lora_expand_kernel[grid](
        h, pool, segments.token_order, segments.seg_starts, page_tables, ranks, b_offsets, scalings, out,
        num_slots, out_features, align_up(out_features), h.shape[1], pool.shape[1],
        h.stride(0), page_tables.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_R=16, BLOCK_N=block_n, N_TILES=n_tiles,
        DOT_PRECISION="ieee" if h.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )
