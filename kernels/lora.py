"""Triton multi-LoRA shrink (`x @ Aᵀ`) and expand (`h @ Bᵀ`, added into the base output) over the
unified page pool (DESIGN §2, §4).

Same signatures and semantics as `lora_shrink` / `lora_expand` in `slora.kernels.reference`, plus
optional keyword arguments. Design (segmented gather matmul, SGMV-style):

- Tokens are grouped by adapter slot: `lora_segments` sorts token indices by slot on the device
  (tokens without adapter, slot -1, sort first and belong to no segment, so they cost nothing). The
  engine can compute the segments once per step and pass them to every call through `segments=`.
- Each program takes a block of up to BLOCK_M tokens of one slot, so an adapter's weights are read
  once per block whether the batch is decode (one token per adapter) or prefill (long segments), and
  the product runs on `tl.dot`. `lora_segments` also maps blocks to slots on the device (a program
  reads its slot and first token directly: decode is latency-bound, so the chain of dependent loads
  before the weights stream is kept short); the number of blocks, `tokens // BLOCK_M + slots`, is a
  host int, so nothing is read back.
- Heterogeneous ranks: shrink splits the rank into BLOCK_R-row blocks, and programs past their
  slot's rank exit; expand loops over the slot's real rank. Rows past the rank are never read.
- A and Bᵀ are read through the slot's page table: element `e` of the logical buffer is
  `pool[page_table[e // page_elems], e % page_elems]`, rows of an `n`-wide matrix start `align_up(n)`
  apart (offsets must be multiples of ALIGN). A tile row (up to 256 columns, at most a page) lies in
  at most two pages, so it needs one or two page-table lookups, and its loads stay vectorised.
- Shrink of few tokens splits the reduction (`in_features`) over SPLIT_K programs that write fp32
  partial sums, summed afterwards in a fixed order (deterministic, no atomics).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from slora.kernels.layout import ALIGN, align_up
from torch import Tensor

# Programs in flight we aim for, per multiprocessor, before splitting the shrink reduction stops paying.
_PROGRAMS_PER_SM = 4
# Each split of the shrink reduction covers at least this many input features.
_MIN_K_PER_SPLIT = 512
# Columns of a row loaded per tile (a power of two >= ALIGN, at most a page).
_MAX_TILE = 128
# Launch parameters: rank rows per shrink program, 64-column tiles per expand program, warps, stages.
_SHRINK_BLOCK_R = 16
_EXPAND_N_TILES = 1
_NUM_WARPS = 4
_NUM_STAGES = 2


class LoraSegments(NamedTuple):
    """Tokens grouped by adapter slot and cut into blocks, computed on the device (no host sync).

    token_order: int32 [tokens], token indices sorted by slot (slot -1 first, stable).
    seg_starts: int32 [num_slots + 1]; the tokens of slot `s` are
        `token_order[seg_starts[s]:seg_starts[s + 1]]`.
    block_slot, block_start: int32 [tokens // block_m + num_slots]; block `i` holds the tokens
        `token_order[block_start[i] : min(block_start[i] + block_m, seg_starts[block_slot[i] + 1])]`
        (none when block_start[i] is already past the slot's end: a spare block).
    block_m: tokens per block."""
    token_order: Tensor
    seg_starts: Tensor
    block_slot: Tensor
    block_start: Tensor
    block_m: int


def lora_segments(token_slots: Tensor, num_slots: int, block_m: int | None = None) -> LoraSegments:
    """Group the tokens of one step by adapter slot; pass the result to every shrink/expand of the step.

    Slot `s`'s blocks are numbered from `(seg_starts[s] - seg_starts[0]) // block_m + s`: counting from
    seg_starts[0] skips tokens without adapter, and the `+ s` leaves room for each slot's last, partial
    block, so `tokens // block_m + num_slots` blocks always suffice, a size known on the host."""
    if token_slots.dim() != 1 or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be a 1-D int32/int64 tensor, got {token_slots.dtype} "
                         f"of shape {tuple(token_slots.shape)}")
    num_tokens, device = token_slots.shape[0], token_slots.device
    if block_m is None:
        block_m = _block_m(num_tokens, num_slots, device)
    sorted_slots, order = torch.sort(token_slots, stable=True)
    slot_ids = torch.arange(num_slots + 1, dtype=sorted_slots.dtype, device=device)
    starts = torch.searchsorted(sorted_slots, slot_ids)                                   # [slots + 1]
    num_blocks = num_tokens // block_m + num_slots
    first_block = (starts[:-1] - starts[0]) // block_m + slot_ids[:-1]                    # [slots]
    blocks = torch.arange(num_blocks, dtype=first_block.dtype, device=device)
    block_slot = (torch.searchsorted(first_block, blocks, right=True) - 1).clamp(min=0)  # [blocks]
    block_start = starts[block_slot] + (blocks - first_block[block_slot]) * block_m
    return LoraSegments(order.to(torch.int32), starts.to(torch.int32), block_slot.to(torch.int32),
                        block_start.to(torch.int32), block_m)


@triton.jit
def _block_rows(seg_ptr, order_ptr, block_slot_ptr, block_start_ptr, block, BLOCK_M: tl.constexpr):
    # Slot of this block, its token indices [BLOCK_M] and their mask, and whether it has no token.
    slot = tl.load(block_slot_ptr + block)
    first = tl.load(block_start_ptr + block)
    seg_hi = tl.load(seg_ptr + slot + 1)
    idx = first + tl.arange(0, BLOCK_M)
    row_mask = idx < seg_hi
    tokens = tl.load(order_ptr + idx, mask=row_mask, other=0).to(tl.int64)
    return slot, tokens, row_mask, first >= seg_hi


@triton.jit
def _load_paged_tile(pool_ptr, pt_row, offset, rows, row_stride, row_len, col0, page_elems, mask,
                     TILE: tl.constexpr, ALIGN_ELEMS: tl.constexpr):
    # Load columns col0 .. col0 + TILE of the given rows of a paged matrix: [len(rows), TILE].
    # Row i starts at logical element offset + i * row_stride, a multiple of ALIGN (the layout's
    # contract), and TILE <= page_elems, so a tile row lies in at most two pages: one page-table
    # lookup for the page it starts in and, only if its valid part runs past that page, one for the
    # next. Every base and the page split are multiples of ALIGN; telling the compiler so lets it
    # keep 16-byte vector loads despite the gather.
    start = offset + rows.to(tl.int64) * row_stride + col0             # [R] logical element
    page_idx = start // page_elems
    in_page = start - page_idx * page_elems
    room = tl.multiple_of(page_elems - in_page, ALIGN_ELEMS)            # columns left in the first page
    crosses = room < row_len - col0
    first = tl.load(pt_row + page_idx).to(tl.int64) * page_elems + in_page
    second = tl.load(pt_row + page_idx + 1, mask=crosses, other=0).to(tl.int64) * page_elems - room
    cols = tl.arange(0, TILE)
    base = tl.where(cols[None, :] < room[:, None], tl.multiple_of(first, ALIGN_ELEMS)[:, None],
                    tl.multiple_of(second, ALIGN_ELEMS)[:, None])
    return tl.load(pool_ptr + base + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, pool_ptr, order_ptr, seg_ptr, block_slot_ptr, block_start_ptr, pt_ptr, ranks_ptr, a_off_ptr, h_ptr,
    in_features, row_stride, max_rank, page_elems, k_per_split,
    stride_xt, stride_pt, stride_hsplit, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN_ELEMS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # h[split, token, r] = sum over this split's k of x[token, k] * A_slot[r, k], for one block of
    # BLOCK_M tokens of one slot and BLOCK_R rank rows. x: [T, in]; h: [splits, T, max_rank].
    block = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R
    split = tl.program_id(2)
    slot, tokens, row_mask, empty = _block_rows(seg_ptr, order_ptr, block_slot_ptr, block_start_ptr, block,
                                                BLOCK_M)
    rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)
    if (r0 >= rank) | empty:
        return   # past this slot's rank (or rank 0), or a spare block: no work, nothing read
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
        a = _load_paged_tile(pool_ptr, pt_row, a_offset, rows_in, row_stride, in_features, k0, page_elems,
                             r_mask[:, None] & k_mask[None, :], BLOCK_K, ALIGN_ELEMS)   # [BLOCK_R, BLOCK_K]
        acc += tl.dot(x, tl.trans(a.to(x.dtype)), input_precision=DOT_PRECISION)
    h_ptrs = h_ptr + split * stride_hsplit + tokens[:, None] * stride_ht + ranks_idx[None, :]
    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    h_ptr, pool_ptr, order_ptr, seg_ptr, block_slot_ptr, block_start_ptr, pt_ptr, ranks_ptr, b_off_ptr,
    scale_ptr, out_ptr, out_features, row_stride, h_cols, page_elems,
    stride_ht, stride_pt, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_TILES: tl.constexpr,
    ALIGN_ELEMS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # out[token, n] += scaling_slot * sum over r < rank of h[token, r] * Bᵀ_slot[r, n], for one block of
    # BLOCK_M tokens of one slot and N_TILES * BLOCK_N output columns. h: [T, h_cols]; out: [T, out].
    block = tl.program_id(0)
    slot, tokens, row_mask, empty = _block_rows(seg_ptr, order_ptr, block_slot_ptr, block_start_ptr, block,
                                                BLOCK_M)
    rank = tl.minimum(tl.load(ranks_ptr + slot), h_cols)
    if (rank <= 0) | empty:
        return   # the adapter does not target this module, or a spare block
    b_offset = tl.load(b_off_ptr + slot)
    scaling = tl.load(scale_ptr + slot).to(tl.float32)
    pt_row = pt_ptr + slot.to(tl.int64) * stride_pt
    cols = tl.arange(0, BLOCK_N)
    h_rows = h_ptr + tokens * stride_ht
    out_rows = out_ptr + tokens * stride_ot
    for tile in tl.static_range(N_TILES):
        n0 = (tl.program_id(1) * N_TILES + tile) * BLOCK_N
        if n0 < out_features:   # the last program's tiles may run past the output
            n_mask = n0 + cols < out_features
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                ranks_idx = r0 + tl.arange(0, BLOCK_R)
                r_mask = ranks_idx < rank
                h = tl.load(h_rows[:, None] + ranks_idx[None, :], mask=row_mask[:, None] & r_mask[None, :],
                            other=0.0)                          # [BLOCK_M, BLOCK_R]
                b = _load_paged_tile(pool_ptr, pt_row, b_offset, tl.where(r_mask, ranks_idx, 0), row_stride,
                                     out_features, n0, page_elems, r_mask[:, None] & n_mask[None, :],
                                     BLOCK_N, ALIGN_ELEMS)      # [BLOCK_R, BLOCK_N]
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
    order, starts, block_slot, block_start, block_m = segments
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"segments.block_m must be 16, 32, 64 or 128, got {block_m}")
    blocks = num_tokens // block_m + num_slots
    expected = {"token_order": (order, num_tokens), "seg_starts": (starts, num_slots + 1),
                "block_slot": (block_slot, blocks), "block_start": (block_start, blocks)}
    for name, (t, n) in expected.items():
        if t.shape != (n,) or t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
            raise ValueError(f"segments.{name} must be a contiguous int32 [{n}] tensor on {device} "
                             f"(use lora_segments), got {t.dtype} {tuple(t.shape)} on {t.device}")


def _block_m(num_tokens: int, num_slots: int, device: torch.device) -> int:
    """Tokens per block: 16 (the smallest tl.dot) unless segments are long on average."""
    if device.type == "cuda" and num_tokens >= 64 * max(num_slots, 1):
        return 64
    return 16


def _tile_width(page_elems: int) -> int:
    """Columns per tile along a row: _MAX_TILE, or less for pages so small that a tile must fit one."""
    width = _MAX_TILE
    while width > page_elems:
        width //= 2
    return width


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one by one: splitting only adds work


def _choose_split_k(num_blocks: int, rank_blocks: int, in_features: int, device: torch.device) -> int:
    """Splits of the shrink reduction: only when there are fewer programs than multiprocessors
    (decode: a handful of tokens per adapter), each split keeping several tiles of work."""
    programs = max(num_blocks * rank_blocks, 1)
    sms = _multiprocessors(device)
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(_PROGRAMS_PER_SM * sms, programs), in_features // _MIN_K_PER_SPLIT))


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
    block_m = segments.block_m
    block_r = _SHRINK_BLOCK_R
    num_blocks = num_tokens // block_m + num_slots
    rank_blocks = triton.cdiv(max_rank, block_r)
    if split_k is None:
        split_k = _choose_split_k(min(num_blocks, num_tokens), rank_blocks, in_features, x.device)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    block_k = _tile_width(pool.shape[1])
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)   # no empty splits
    # Rows without adapter and columns past each slot's rank stay zero.
    h = torch.zeros((max(1, split_k), num_tokens, max_rank),
                    dtype=torch.float32 if split_k > 1 else x.dtype, device=x.device)
    if num_tokens == 0 or num_slots == 0:
        return h[0]
    _lora_shrink_kernel[(num_blocks, rank_blocks, split_k)](
        x, pool, segments.token_order, segments.seg_starts, segments.block_slot, segments.block_start,
        page_tables, ranks, a_offsets, h, in_features, align_up(in_features), max_rank, pool.shape[1], k_per_split,
        x.stride(0), page_tables.stride(0), h.stride(0), h.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, ALIGN_ELEMS=ALIGN,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
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
    block_m = segments.block_m
    block_n = _tile_width(pool.shape[1])
    n_tiles = _EXPAND_N_TILES
    grid = (num_tokens // block_m + num_slots, triton.cdiv(out_features, block_n * n_tiles))
    _lora_expand_kernel[grid](
        h, pool, segments.token_order, segments.seg_starts, segments.block_slot, segments.block_start,
        page_tables, ranks, b_offsets, scalings, out, out_features, align_up(out_features), h.shape[1], pool.shape[1],
        h.stride(0), page_tables.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_R=16, BLOCK_N=block_n, N_TILES=n_tiles, ALIGN_ELEMS=ALIGN,
        DOT_PRECISION="ieee" if h.dtype == torch.float32 else "tf32",
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
