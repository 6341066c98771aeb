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
  apart (offsets must be multiples of ALIGN). A tile row (at most a page) lies in
  at most two pages, so it needs one or two page-table lookups. A tile of ALIGN columns lies in one
  page, so its page is chosen per row; a wider tile chooses per column, which Triton 3.6 compiles to
  16-byte vector loads and Triton 3.9 to 2-byte loads (benchmarks/ptx_loads.py).
- Shrink of few tokens splits the reduction (`in_features`) over SPLIT_K programs that write fp32
  partial sums (`lora_shrink(partials=True)` returns them; by default it returns their sum); expand sums
  them in a fixed order as it reads h (deterministic, no atomics, and no launch of its own: decode LoRA
  is bound by launch latency, not bytes). `lora_shrink(out=h)` instead adds every split into one
  caller-zeroed h with atomics, so the reduction can be split finer (up to 32) at no cost to expand; the
  float32 order of those additions is not fixed. The engine uses it for small steps
  (slora.execution.lora_backend.LoraLaunchPolicy).
- Fused modules: the tables may be `[modules, slots]` for up to three modules that share an input
  (q/k/v, gate/up), so one shrink launch and one expand launch (into the fused qkv or gate_up output,
  `out_sizes` columns per module) serve them all: 8 launches per layer for seven projections.
"""
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from slora.kernels.checks import LORA_GEMV_TILE, check_adapter_span
from slora.kernels.layout import ALIGN, align_up, cdiv
from slora.kernels.pdl import check_pdl_supported, launch_options, pdl_start, pdl_wait

# Programs we aim for per multiprocessor when splitting the shrink reduction (decode: few tokens).
_PROGRAMS_PER_SM = 2
# Each split of the shrink reduction covers at least this many input features, and there are at most
# _MAX_SPLIT_K splits (expand sums the partial results of every split when it reads h).
_MIN_K_PER_SPLIT = 256
_MAX_SPLIT_K = 8
# With lora_shrink(out=h) the splits add into one h atomically, so expand's cost does not grow with them.
_MAX_ACCUMULATE_SPLIT_K = 32
# Modules fused into one launch: up to three that share their input (q/k/v, gate/up).
_MAX_MODULES = 3
# The constants below are fixed for the product; the tests set them (monkeypatch) to reach every path.
# Output tiles each expand program covers. More means fewer programs that only find a spare block, but
# on the H200 one was fastest (docs/decisions.md, the LoRA kernel runs).
_EXPAND_N_TILES = 1
# Columns of a row loaded per tile (a power of two >= ALIGN, at most a page): shrink's reduction
# chunk and expand's output tile. Wider tiles put more bytes in flight per program and need fewer
# programs; 64 was slower on the H200.
_SHRINK_TILE = 128
_EXPAND_TILE = 128
# Shrink looks up each row's pages once before its reduction loop, where a split's run of a row fits in
# a page, instead of in every step of the loop: on the H200 the Llama-3-8B layer's LoRA went from 148.1
# to 141.6 µs (64 distinct adapters).
_HOIST_PAGES = True
# Launch parameters: rank rows per shrink program, 64-column tiles per expand program, warps, stages.
_SHRINK_BLOCK_R = 16
_NUM_WARPS = 4
_NUM_STAGES = 2
# Warps of the expand's one-token (gemv) kernel: 8 columns each of its threads. On the H200 the layer's
# expands with 256 distinct adapters took 205.1 / 200.5 / 197.0 µs with 1 / 2 / 4 warps (256- to 1024-column
# tiles), measured on its first version (a branch between rows: docs/decisions.md), not re-measured since.
_GEMV_WARPS = LORA_GEMV_TILE // (8 * 32)


class LoraSegments(NamedTuple):
    """Tokens grouped by adapter slot and cut into blocks, computed on the device (no host sync).

    token_order: int32 [tokens], token indices sorted by slot (slot -1 first, stable).
    seg_starts: int32 [num_slots + 1]; the tokens of slot `s` are
        `token_order[seg_starts[s]:seg_starts[s + 1]]`.
    block_slot, block_start, block_end: int32 [tokens // block_m + num_slots]; block `i` holds the tokens
        `token_order[block_start[i] : block_end[i]]`, at most block_m of slot block_slot[i] (none in a spare
        block: block_end[i] <= block_start[i]). The end is stored rather than looked up in seg_starts so a
        program knows its tokens after one round of loads (decode is latency-bound).
    block_m: tokens per block."""
    token_order: Tensor
    seg_starts: Tensor
    block_slot: Tensor
    block_start: Tensor
    block_end: Tensor
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
    block_end = torch.minimum(block_start + block_m, starts[block_slot + 1])
    return LoraSegments(order.to(torch.int32), starts.to(torch.int32), block_slot.to(torch.int32),
                        block_start.to(torch.int32), block_end.to(torch.int32), block_m)


@triton.jit
def _block_rows(order_ptr, block_slot_ptr, block_start_ptr, block_end_ptr, block, BLOCK_M: tl.constexpr):
    # Slot of this block, its token indices [BLOCK_M] and their mask, and whether it has no token.
    slot = tl.load(block_slot_ptr + block)
    first = tl.load(block_start_ptr + block)
    end = tl.load(block_end_ptr + block)
    idx = first + tl.arange(0, BLOCK_M)
    row_mask = idx < end
    tokens = tl.load(order_ptr + idx, mask=row_mask, other=0).to(tl.int64)
    return slot, tokens, row_mask, first >= end


@triton.jit
def _split_pages(pt_row, offset, rows, row_stride, col0, length, page_elems, ALIGN_ELEMS: tl.constexpr):
    # Where columns col0 .. col0 + length of the given rows of a paged matrix lie, for length <= a page.
    # Row i starts at logical element offset + i * row_stride, a multiple of ALIGN (the layout's
    # contract), so each row's run crosses at most one page boundary: one page-table lookup for the page
    # it starts in and, only if the run goes past that page, one for the next. Returns, per row [R], the
    # physical offset of col0 (`first`), that of the boundary minus `room` (`second`: column col0 + c,
    # c >= room, is at second + c) and `room`, the columns before the boundary. Every one is a multiple
    # of ALIGN (the hints do not survive a `where` between them: _load_run rounds its run's start again).
    # int32: the wrappers check that an adapter's pages hold fewer than 2**31 elements, and a 64-bit division
    # compiles to a call in the chain of loads before the weights.
    start = (offset + rows * row_stride + col0).to(tl.int32)             # [R] logical element
    page_idx = start // page_elems
    in_page = start - page_idx * page_elems
    room = tl.multiple_of(page_elems - in_page, ALIGN_ELEMS)
    first = tl.load(pt_row + page_idx).to(tl.int64) * page_elems + in_page
    second = tl.load(pt_row + page_idx + 1, mask=room < length, other=0).to(tl.int64) * page_elems - room
    return tl.multiple_of(first, ALIGN_ELEMS), tl.multiple_of(second, ALIGN_ELEMS), room


@triton.jit
def _load_run(pool_ptr, first, second, room, col_off, row_mask, col_mask, WIDTH: tl.constexpr,
              ALIGN_ELEMS: tl.constexpr):
    # Columns col_off .. col_off + WIDTH (counted from the run's col0; col_off a multiple of ALIGN) of the
    # rows located by _split_pages, where row_mask [R] and col_mask [WIDTH] (else 0): [R, WIDTH].
    mask = row_mask[:, None] & col_mask[None, :]
    if WIDTH == ALIGN_ELEMS:
        # A page boundary falls on a multiple of ALIGN, so the run lies in one page: its page is chosen per
        # row and its columns are contiguous. Columns past the row's end are its ALIGN padding, in the same
        # page: they are loaded with the row and zeroed after, so that the load's mask is constant along a
        # row. Both keep 16-byte vector loads in the sm_90 PTX (benchmarks/ptx_loads.py).
        start = (tl.where(col_off < room, first, second) + col_off) // ALIGN_ELEMS * ALIGN_ELEMS   # [R]
        run = tl.load(pool_ptr + start[:, None] + tl.arange(0, WIDTH)[None, :], mask=row_mask[:, None],
                      other=0.0)
        return tl.where(mask, run, 0.0)
    # Wider runs choose the page per column. Whether the loads stay 16 bytes wide depends on whether
    # Triton sees that the choice is constant over 16-byte runs: 3.6 does, 3.9 loads every element alone.
    cols = col_off + tl.arange(0, WIDTH)
    base = tl.where(cols[None, :] < room[:, None], first[:, None], second[:, None])
    return tl.load(pool_ptr + base + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _load_paged_tile(pool_ptr, pt_row, offset, rows, row_stride, row_len, col0, page_elems, row_mask, col_mask,
                     TILE: tl.constexpr, ALIGN_ELEMS: tl.constexpr):
    # Load columns col0 .. col0 + TILE (TILE <= page_elems) of the given rows of a paged matrix whose rows
    # have row_len valid columns: [len(rows), TILE].
    first, second, room = _split_pages(pt_row, offset, rows, row_stride, col0, row_len - col0, page_elems,
                                       ALIGN_ELEMS)
    return _load_run(pool_ptr, first, second, room, 0, row_mask, col_mask, TILE, ALIGN_ELEMS)


@triton.jit
def _shrink_rows(x_rows, row_mask, pool_ptr, pt_row, a_offset, rows, r_mask, k_lo, k_hi, in_features, row_stride,
                 page_elems, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 ALIGN_ELEMS: tl.constexpr, DOT_PRECISION: tl.constexpr, HOIST_PAGES: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    # x[tokens, k_lo:k_hi] @ A[rows, k_lo:k_hi]ᵀ: [BLOCK_M, BLOCK_R] float32. x_rows: [BLOCK_M] row pointers.
    # HOIST_PAGES (the run k_lo..k_hi of a row fits in a page): each row's pages are looked up once, before
    # the loop, instead of in every step of it. USE_PDL: those lookups and the first chunk of A are read
    # before waiting for the previous kernel, x after (k_lo < k_hi: no split is empty).
    if HOIST_PAGES:
        first, second, room = _split_pages(pt_row, a_offset, rows, row_stride, k_lo, k_hi - k_lo, page_elems,
                                           ALIGN_ELEMS)
    else:   # unused: each chunk looks its pages up
        first, second, room = k_lo, k_lo, k_lo
    a = _a_chunk(pool_ptr, pt_row, a_offset, rows, r_mask, k_lo, k_lo, in_features, row_stride, page_elems, first,
                 second, room, BLOCK_K, ALIGN_ELEMS, HOIST_PAGES)                             # [BLOCK_R, BLOCK_K]
    pdl_wait(USE_PDL)
    acc = _x_chunk_dot(x_rows, row_mask, k_lo, in_features, a, tl.zeros([BLOCK_M, BLOCK_R], tl.float32), BLOCK_K,
                       DOT_PRECISION)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        a = _a_chunk(pool_ptr, pt_row, a_offset, rows, r_mask, k0, k_lo, in_features, row_stride, page_elems, first,
                     second, room, BLOCK_K, ALIGN_ELEMS, HOIST_PAGES)
        acc = _x_chunk_dot(x_rows, row_mask, k0, in_features, a, acc, BLOCK_K, DOT_PRECISION)
    return acc


@triton.jit
def _a_chunk(pool_ptr, pt_row, a_offset, rows, r_mask, k0, k_lo, in_features, row_stride, page_elems, first, second,
             room, BLOCK_K: tl.constexpr, ALIGN_ELEMS: tl.constexpr, HOIST_PAGES: tl.constexpr):
    # Columns k0 .. k0 + BLOCK_K of A's rows: [BLOCK_R, BLOCK_K]; hoisted lookups count columns from k_lo.
    cols = tl.arange(0, BLOCK_K)
    k_mask = k0 + cols < in_features
    if HOIST_PAGES:
        return _load_run(pool_ptr, first, second, room, k0 - k_lo, r_mask, k_mask, BLOCK_K, ALIGN_ELEMS)
    return _load_paged_tile(pool_ptr, pt_row, a_offset, rows, row_stride, in_features, k0, page_elems, r_mask, k_mask,
                            BLOCK_K, ALIGN_ELEMS)


@triton.jit
def _x_chunk_dot(x_rows, row_mask, k0, in_features, a, acc, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # acc [BLOCK_M, BLOCK_R] + x[tokens, k0:k0 + BLOCK_K] @ aᵀ.
    cols = tl.arange(0, BLOCK_K)
    k_mask = k0 + cols < in_features
    x = tl.load(x_rows[:, None] + k0 + cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    return acc + tl.dot(x, tl.trans(a.to(x.dtype)), input_precision=DOT_PRECISION)


@triton.jit
def _rank_rows(r0, rank, BLOCK_R: tl.constexpr):
    # Rank rows r0 .. r0 + BLOCK_R: their indices [BLOCK_R], which lie below the rank, and the indices with
    # the others clamped to row 0, so that their page-table lookups stay inside the table.
    idx = r0 + tl.arange(0, BLOCK_R)
    mask = idx < rank
    return idx, mask, tl.where(mask, idx, 0)


@triton.jit
def _out_tile(out_ptr, out_rows, col0, cols, row_mask, n_mask, ADD: tl.constexpr):
    # The output tile out[rows, col0 + cols]: its pointers and mask, and its values [BLOCK_M, BLOCK_N] in
    # out's dtype (loaded where the caller wants them in its chain of loads); zeros when the kernel
    # overwrites the tile instead of adding into it (ADD false: nothing is read).
    o_ptrs = out_ptr + out_rows[:, None] + col0 + cols[None, :]
    o_mask = row_mask[:, None] & n_mask[None, :]
    if ADD:
        base = tl.load(o_ptrs, mask=o_mask, other=0.0)
    else:
        base = tl.zeros(o_mask.shape, out_ptr.dtype.element_ty)
    return o_ptrs, o_mask, base


@triton.jit
def _zero_row(out_ptr, out_row, col0, out_features, BLOCK_N: tl.constexpr):
    # Zeros into one row's columns col0 .. col0 + BLOCK_N of a module (out_row: the element offset of the
    # row's first column of the module): the delta of a module the adapter does not target, when the expand
    # overwrites. Nothing of the adapter is read, so no page lookup can go past a narrow page table.
    cols = tl.arange(0, BLOCK_N)
    tl.store(out_ptr + out_row + col0 + cols, tl.zeros([BLOCK_N], out_ptr.dtype.element_ty),
             mask=col0 + cols < out_features)


@triton.jit
def _store_scaled(o_ptrs, o_mask, base, acc, scaling):
    # base + scaling * acc into the tile, in float32 and rounded once to out's dtype.
    tl.store(o_ptrs, (base.to(tl.float32) + acc * scaling).to(base.dtype), mask=o_mask)


# Ints that change with the step's size (k_per_split, stride_hsplit) stay specialised: without it
# (do_not_specialize) decode steps on the H200 took 2-40% longer (docs/decisions.md). The variants that
# mixed steps need are compiled at start (ModelRunner.warm_up). What changes with the step's adapter mix
# (the per-slot tables' pointers, whose 16-byte alignment depends on the layer and the slot count, and
# their strides) is read once per program, so it is not specialised: each mix would compile its own
# variant in the middle of serving.
_TABLE_ARGS = ("pt_ptr", "ranks_ptr", "stride_pt", "stride_rm")


@triton.jit(do_not_specialize=_TABLE_ARGS + ("a_off_ptr", "stride_am"))
def _lora_shrink_kernel(
    x_ptr, pool_ptr, order_ptr, block_slot_ptr, block_start_ptr, block_end_ptr, pt_ptr, ranks_ptr, a_off_ptr, h_ptr,
    in_features, row_stride, max_rank, rank_blocks, page_elems, k_per_split,
    stride_xt, stride_pt, stride_rm, stride_am, stride_hsplit, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN_ELEMS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, HOIST_PAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # USE_PDL: the block's tables, its page lookups and its first chunk of A are read before waiting for
    # the previous kernel, x after (pdl_wait in _shrink_rows).
    # ACCUMULATE: every split adds into h[token, m * max_rank + r] (atomically; stride_hsplit is 0). Else:
    # h[split, token, m * max_rank + r] = sum over this split's k of x[token, k] * A_{m,slot}[r, k], for
    # one block of BLOCK_M tokens of one slot, module m and BLOCK_R rank rows. Modules share x (q/k/v).
    # x: [T, in]; h: [splits, T, modules * max_rank] float32.
    block = tl.program_id(0)
    module = tl.program_id(1) // rank_blocks
    r0 = (tl.program_id(1) % rank_blocks) * BLOCK_R
    split = tl.program_id(2)
    pdl_start(USE_PDL)
    slot, tokens, row_mask, empty = _block_rows(order_ptr, block_slot_ptr, block_start_ptr, block_end_ptr, block,
                                                BLOCK_M)
    rank = tl.minimum(tl.load(ranks_ptr + module * stride_rm + slot), max_rank)
    if (r0 >= rank) | empty:
        pdl_wait(USE_PDL)
        return   # past this slot's rank (or rank 0), or a spare block: no work, nothing read
    ranks_idx, r_mask, rows_in = _rank_rows(r0, rank, BLOCK_R)
    a_offset = tl.load(a_off_ptr + module * stride_am + slot)
    pt_row = pt_ptr + slot.to(tl.int64) * stride_pt
    k_lo = split * k_per_split
    acc = _shrink_rows(x_ptr + tokens * stride_xt, row_mask, pool_ptr, pt_row, a_offset, rows_in, r_mask, k_lo,
                       tl.minimum(k_lo + k_per_split, in_features), in_features, row_stride, page_elems,
                       BLOCK_M, BLOCK_R, BLOCK_K, ALIGN_ELEMS, DOT_PRECISION, HOIST_PAGES,
                       USE_PDL)   # [BLOCK_M, BLOCK_R]
    h_cols = module * max_rank + ranks_idx
    h_ptrs = h_ptr + split * stride_hsplit + tokens[:, None] * stride_ht + h_cols[None, :]
    if ACCUMULATE:
        tl.atomic_add(h_ptrs, acc, mask=row_mask[:, None] & r_mask[None, :], sem="relaxed")
    else:
        tl.store(h_ptrs, acc, mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def _pick(module, v0, v1, v2):
    # The value of module 0, 1 or 2 (scalars or tensors of one shape).
    return tl.where(module == 0, v0, tl.where(module == 1, v1, v2))


@triton.jit
def _module_of_tile(tile, n0, n1, BLOCK_N: tl.constexpr):
    # Which of up to three column ranges (widths n0, n1, n2 side by side in `out`) output tile `tile`
    # belongs to: (module, the module's first column in out, the tile's first column in the module).
    t0 = tl.cdiv(n0, BLOCK_N)
    t1 = tl.cdiv(n1, BLOCK_N)
    module = (tile >= t0).to(tl.int32) + (tile >= t0 + t1).to(tl.int32)
    return module, _pick(module, 0, n0, n0 + n1), (tile - _pick(module, 0, t0, t0 + t1)) * BLOCK_N


# num_splits: 1 or the shrink's split count, which changes with the step's size (a loop bound).
@triton.jit(do_not_specialize=_TABLE_ARGS + ("b_off_ptr", "scale_ptr", "stride_bm", "stride_sm", "num_splits"))
def _lora_expand_kernel(
    h_ptr, pool_ptr, order_ptr, block_slot_ptr, block_start_ptr, block_end_ptr, pt_ptr, ranks_ptr, b_off_ptr,
    scale_ptr, out_ptr, n0, n1, n2, h_rank, num_splits, num_tiles, page_elems,
    stride_hsplit, stride_ht, stride_pt, stride_rm, stride_bm, stride_sm, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_TILES: tl.constexpr,
    ALIGN_ELEMS: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, ADD: tl.constexpr,
):
    # ADD false: the block's rows of out are overwritten with the LoRA delta, zeros in modules the adapter
    # does not target (rank 0), instead of added into.
    # USE_PDL: the block's tables, page lookups and first rank block of Bᵀ are read before waiting for the
    # previous kernel (the shrink that writes h), h and out after (pdl_wait).
    # out[token, col_m + n] += scaling_{m,slot} * sum over r < rank of h[token, m * h_rank + r] * Bᵀ_{m,slot}[r, n]
    # for one block of BLOCK_M tokens of one slot and N_TILES BLOCK_N-column tiles of the modules' columns.
    # h: [splits, T, modules * h_rank], summed over splits here (shrink's split reduction, in a fixed
    # order: deterministic); out: [T, n0 + n1 + n2].
    block = tl.program_id(0)
    pdl_start(USE_PDL)
    slot, tokens, row_mask, empty = _block_rows(order_ptr, block_slot_ptr, block_start_ptr, block_end_ptr, block,
                                                BLOCK_M)
    if empty:
        pdl_wait(USE_PDL)
        return   # a spare block
    pt_row = pt_ptr + slot.to(tl.int64) * stride_pt
    h_rows = h_ptr + tokens * stride_ht
    for t in tl.static_range(N_TILES):
        tile = tl.program_id(1) * N_TILES + t
        module, out_col, col0 = _module_of_tile(tile, n0, n1, BLOCK_N)
        # Tiles past the last one (the last program's) read no table entry: there may be no such module.
        rank = tl.minimum(tl.load(ranks_ptr + module * stride_rm + slot, mask=tile < num_tiles, other=0), h_rank)
        if rank > 0:   # rank 0: the adapter does not target this module
            _expand_tile(h_rows + module * h_rank, pool_ptr, pt_row, out_ptr, tokens * stride_ot + out_col,
                         tl.load(b_off_ptr + module * stride_bm + slot),
                         tl.load(scale_ptr + module * stride_sm + slot).to(tl.float32),
                         _pick(module, n0, n1, n2), col0, rank, num_splits,
                         stride_hsplit, page_elems, row_mask, BLOCK_M, BLOCK_R, BLOCK_N, ALIGN_ELEMS, DOT_PRECISION,
                         USE_PDL, ADD)
        elif not ADD:
            # Overwriting: the tile's delta is 0 (a tile past the last one has no columns left: all masked).
            pdl_wait(USE_PDL)
            cols = tl.arange(0, BLOCK_N)
            o_ptrs, o_mask, zeros = _out_tile(out_ptr, tokens * stride_ot + out_col, col0, cols, row_mask,
                                              col0 + cols < _pick(module, n0, n1, n2), False)
            tl.store(o_ptrs, zeros, mask=o_mask)
    pdl_wait(USE_PDL)   # for programs whose tiles all had rank 0


@triton.jit
def _b_block(pool_ptr, pt_row, b_offset, row_stride, out_features, col0, r0, rank, page_elems, n_mask,
             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN_ELEMS: tl.constexpr):
    # Rows r0 .. r0 + BLOCK_R of Bᵀ in the tile's columns: [BLOCK_R, BLOCK_N] (rows past the rank are 0).
    _, r_mask, rows = _rank_rows(r0, rank, BLOCK_R)
    return _load_paged_tile(pool_ptr, pt_row, b_offset, rows, row_stride, out_features, col0, page_elems,
                            r_mask, n_mask, BLOCK_N, ALIGN_ELEMS)


@triton.jit
def _h_dot(h_rows, r0, rank, num_splits, stride_hsplit, row_mask, b, acc, out_dtype: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] + h[:, r0:r0 + BLOCK_R] @ b, h summed over the shrink's splits.
    ranks_idx, r_mask, _ = _rank_rows(r0, rank, BLOCK_R)
    h_mask = row_mask[:, None] & r_mask[None, :]
    h = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for split in range(num_splits):
        h += tl.load(h_rows[:, None] + split * stride_hsplit + ranks_idx[None, :], mask=h_mask,
                     other=0.0).to(tl.float32)                    # [BLOCK_M, BLOCK_R]
    # h in the output's dtype, like a matmul of the two factors would see it.
    return acc + tl.dot(h.to(out_dtype), b.to(out_dtype), input_precision=DOT_PRECISION)


@triton.jit
def _expand_tile(h_rows, pool_ptr, pt_row, out_ptr, out_rows, b_offset, scaling, out_features, col0, rank, num_splits,
                 stride_hsplit, page_elems, row_mask,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN_ELEMS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, ADD: tl.constexpr):
    # One module's BLOCK_N columns from col0 for the block's rows: out += scaling * h[:, :rank] @ Bᵀ[:rank]
    # (ADD false: out = ..., and rank 0 writes zeros).
    # out_rows: [BLOCK_M] element offsets of the rows' first column of this module in out. The first rank
    # block of Bᵀ is read before waiting for the previous kernel (USE_PDL); after the wait, the out tile is
    # loaded together with h, not after the product, to shorten the chain of dependent loads.
    row_stride = tl.cdiv(out_features, ALIGN_ELEMS) * ALIGN_ELEMS
    cols = tl.arange(0, BLOCK_N)
    n_mask = col0 + cols < out_features
    dtype = out_ptr.dtype.element_ty
    b = _b_block(pool_ptr, pt_row, b_offset, row_stride, out_features, col0, 0, rank, page_elems, n_mask,
                 BLOCK_R, BLOCK_N, ALIGN_ELEMS)                                   # [BLOCK_R, BLOCK_N]
    pdl_wait(USE_PDL)
    o_ptrs, o_mask, base = _out_tile(out_ptr, out_rows, col0, cols, row_mask, n_mask, ADD)
    acc = _h_dot(h_rows, 0, rank, num_splits, stride_hsplit, row_mask, b, tl.zeros([BLOCK_M, BLOCK_N], tl.float32),
                 dtype, BLOCK_M, BLOCK_R, DOT_PRECISION)
    for r0 in range(BLOCK_R, rank, BLOCK_R):
        b = _b_block(pool_ptr, pt_row, b_offset, row_stride, out_features, col0, r0, rank, page_elems, n_mask,
                     BLOCK_R, BLOCK_N, ALIGN_ELEMS)
        acc = _h_dot(h_rows, r0, rank, num_splits, stride_hsplit, row_mask, b, acc, dtype, BLOCK_M, BLOCK_R,
                     DOT_PRECISION)
    _store_scaled(o_ptrs, o_mask, base, acc, scaling)


@triton.jit
def _row_run(pool_ptr, pt_row, offset, r, rank, row_stride, col0, length, page_elems, cols, col_mask,
             ALIGN_ELEMS: tl.constexpr):
    # Columns col0 + cols of row r of a paged matrix (0 past the rank or outside col_mask): [len(cols)]. The
    # row's pages are looked up as scalars (_split_pages of one row; a row past the rank looks up row 0's,
    # which exist, and loads nothing).
    first, second, room = _split_pages(pt_row, offset, tl.where(r < rank, r, 0), row_stride, col0, length,
                                       page_elems, ALIGN_ELEMS)
    base = tl.where(cols < room, first, second)
    # (the row's mask as a tensor: the interpreter makes `tensor & scalar` an int)
    return tl.load(pool_ptr + base + cols, mask=col_mask & (tl.zeros_like(cols) + r < rank), other=0.0)


@triton.jit
def _b_row_dot(h_row, pool_ptr, pt_row, b_offset, row_stride, col0, length, rank, r0, num_splits, stride_hsplit,
               page_elems, cols, n_mask, out_dtype: tl.constexpr, BLOCK_R: tl.constexpr, ALIGN_ELEMS: tl.constexpr,
               MAX_SPLITS: tl.constexpr):
    # sum over r in r0 .. r0 + BLOCK_R (below the rank) of h[token, r] * Bᵀ[r, col0 + cols]: [BLOCK_N] float32,
    # one row of Bᵀ at a time, h rounded to the output's dtype as tl.dot's operand would be.
    acc = tl.zeros(cols.shape, tl.float32)
    for i in tl.static_range(BLOCK_R):
        r = r0 + i
        # The splits' partial sums, unrolled (masked past num_splits): a loop would put a branch between the
        # rows, and the next row's loads could not be issued before this row's are used.
        h = 0.0
        for split in tl.static_range(MAX_SPLITS):
            h += tl.load(h_row + split * stride_hsplit + r, mask=(r < rank) & (split < num_splits),
                         other=0.0).to(tl.float32)
        b = _row_run(pool_ptr, pt_row, b_offset, r, rank, row_stride, col0, length, page_elems, cols, n_mask,
                     ALIGN_ELEMS)
        # Triton has no types: mypy sees the float h starts as, not the tensor the loads make it in the kernel.
        acc += h.to(out_dtype).to(tl.float32) * b.to(tl.float32)  # type: ignore[attr-defined]
    return acc


@triton.jit(do_not_specialize=_TABLE_ARGS + ("b_off_ptr", "scale_ptr", "stride_bm", "stride_sm", "num_splits"))
def _lora_expand_gemv_kernel(
    h_ptr, pool_ptr, order_ptr, block_slot_ptr, block_start_ptr, block_end_ptr, pt_ptr, ranks_ptr, b_off_ptr,
    scale_ptr, out_ptr, n0, n1, n2, h_rank, num_splits, page_elems,
    stride_hsplit, stride_ht, stride_pt, stride_rm, stride_bm, stride_sm, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_N: tl.constexpr,
    ALIGN_ELEMS: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, MAX_SPLITS: tl.constexpr,
    ADD: tl.constexpr,
):
    # As _lora_expand_kernel for one BLOCK_N-column tile. A block of one token (decode with an adapter per
    # request) runs without tl.dot: out[token, n] += scaling * sum over r of h[token, r] * Bᵀ[r, n], a row of
    # Bᵀ at a time, so that the sum over the rank stays within each thread and no register holds tl.dot's
    # 16-row padding. A block of several tokens runs _expand_tile over DOT_N-column parts of the tile.
    block = tl.program_id(0)
    pdl_start(USE_PDL)
    slot = tl.load(block_slot_ptr + block)
    first = tl.load(block_start_ptr + block)
    end = tl.load(block_end_ptr + block)
    module, out_col, col0 = _module_of_tile(tl.program_id(1), n0, n1, BLOCK_N)
    rank = tl.minimum(tl.load(ranks_ptr + module * stride_rm + slot), h_rank)
    # A spare block, or (when adding) the adapter does not target this module.
    done = first >= end
    if ADD:
        done = done | (rank == 0)
    if done:
        pdl_wait(USE_PDL)
        return
    out_features = _pick(module, n0, n1, n2)
    if rank == 0:
        # Overwriting: the module's delta is 0. A row at a time: a [BLOCK_M, BLOCK_N] tile of pointers would
        # cost this kernel registers that its other paths do not need.
        pdl_wait(USE_PDL)
        for i in range(first, end):
            _zero_row(out_ptr, tl.load(order_ptr + i).to(tl.int64) * stride_ot + out_col, col0, out_features, BLOCK_N)
        return
    b_offset = tl.load(b_off_ptr + module * stride_bm + slot)
    scaling = tl.load(scale_ptr + module * stride_sm + slot).to(tl.float32)
    pt_row = pt_ptr + slot.to(tl.int64) * stride_pt
    pdl_wait(USE_PDL)
    if end - first == 1:
        token = tl.load(order_ptr + first).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        n_mask = col0 + cols < out_features
        h_row = h_ptr + token * stride_ht + module * h_rank
        acc = tl.zeros([BLOCK_N], tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            acc += _b_row_dot(h_row, pool_ptr, pt_row, b_offset, tl.cdiv(out_features, ALIGN_ELEMS) * ALIGN_ELEMS,
                              col0, out_features - col0, rank, r0, num_splits, stride_hsplit, page_elems, cols,
                              n_mask, out_ptr.dtype.element_ty, BLOCK_R, ALIGN_ELEMS, MAX_SPLITS)
        o_ptrs = out_ptr + token * stride_ot + out_col + col0 + cols
        if ADD:
            acc = tl.load(o_ptrs, mask=n_mask, other=0.0).to(tl.float32) + acc * scaling
        else:
            acc = acc * scaling
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        idx = first + tl.arange(0, BLOCK_M)
        row_mask = idx < end
        tokens = tl.load(order_ptr + idx, mask=row_mask, other=0).to(tl.int64)
        for part in range(0, tl.minimum(BLOCK_N, out_features - col0), DOT_N):
            _expand_tile(h_ptr + tokens * stride_ht + module * h_rank, pool_ptr, pt_row, out_ptr,
                         tokens * stride_ot + out_col, b_offset, scaling, out_features, col0 + part, rank, num_splits,
                         stride_hsplit, page_elems, row_mask, BLOCK_M, BLOCK_R, DOT_N, ALIGN_ELEMS, DOT_PRECISION,
                         False, ADD)


# ----------------------------------------------------------------------------------------------------
# Wrappers


def check_pdl(pdl: bool, segments: LoraSegments | None, device: torch.device) -> None:
    """With pdl=True, shrink and expand start while earlier kernels of the stream still run and read their
    tables (segments, page tables, ranks, offsets, scalings) and the pool's adapter weights before waiting
    for them (slora.kernels.pdl); x, h and out are read after. So those must not come from a kernel that
    may still be running: segments must be computed beforehand (as the engine does, once per step, before
    the layers) and passed."""
    if not pdl:
        return
    if segments is None:
        raise ValueError("pdl=True needs segments computed beforehand (lora_segments), not in the same call")
    check_pdl_supported(pdl, device)


def _check_common(name: str, act: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                  ranks: Tensor, offsets: Tensor) -> int:
    """Checks shared by shrink and expand; `act` is the [tokens, features] activation (x or out).
    Returns the number of modules: 1 for `[slots]` tables, M for `[M, slots]` ones."""
    if act.dim() != 2:
        raise ValueError(f"{name} must be [tokens, features], got shape {tuple(act.shape)}")
    if act.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {act.dtype}")
    if act.shape[1] == 0:
        raise ValueError(f"{name} has no features (shape {tuple(act.shape)})")
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
    check_adapter_span(page_tables.shape[1], pool.shape[1], "a row of page_tables")
    for label, t in (("token_slots", token_slots), ("page_tables", page_tables), ("ranks", ranks),
                     ("offsets", offsets)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{label} must be int32 or int64, got {t.dtype}")
    modules = _check_module_table("ranks", ranks, page_tables.shape[0])
    if _check_module_table("offsets", offsets, page_tables.shape[0]) != modules:
        raise ValueError(f"offsets must have the shape of ranks {tuple(ranks.shape)}, got {tuple(offsets.shape)}")
    return modules


def _check_module_table(label: str, table: Tensor, num_slots: int) -> int:
    """A per-slot table: `[slots]` (one module) or `[modules, slots]` with stride 1 along slots."""
    one = table.dim() == 1 and table.shape[0] == num_slots
    many = table.dim() == 2 and 1 <= table.shape[0] <= _MAX_MODULES and table.shape[1] == num_slots
    if not (one or many) or table.stride(-1) != 1:
        raise ValueError(f"{label} must be a [slots={num_slots}] or [modules<={_MAX_MODULES}, slots={num_slots}] "
                         f"tensor with stride 1 along slots, got shape {tuple(table.shape)}")
    return 1 if one else table.shape[0]


def _module_stride(table: Tensor) -> int:
    return table.stride(0) if table.dim() == 2 else 0


def _check_devices(*tensors: Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def _check_segments(segments: LoraSegments, num_tokens: int, num_slots: int, device: torch.device) -> None:
    order, starts, block_slot, block_start, block_end, block_m = segments
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"segments.block_m must be 16, 32, 64 or 128, got {block_m}")
    blocks = num_tokens // block_m + num_slots
    expected = {"token_order": (order, num_tokens), "seg_starts": (starts, num_slots + 1),
                "block_slot": (block_slot, blocks), "block_start": (block_start, blocks),
                "block_end": (block_end, blocks)}
    for name, (t, n) in expected.items():
        if t.shape != (n,) or t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
            raise ValueError(f"segments.{name} must be a contiguous int32 [{n}] tensor on {device} "
                             f"(use lora_segments), got {t.dtype} {tuple(t.shape)} on {t.device}")


def _segments_for(segments: LoraSegments | None, token_slots: Tensor, num_tokens: int, num_slots: int,
                  device: torch.device) -> LoraSegments:
    if segments is None:
        segments = lora_segments(token_slots, num_slots)
    _check_segments(segments, num_tokens, num_slots, device)
    return segments


def _block_m(num_tokens: int, num_slots: int, device: torch.device) -> int:
    """Tokens per block: 16 (the smallest tl.dot) unless segments are long on average."""
    if device.type == "cuda" and num_tokens >= 64 * max(num_slots, 1):
        return 64
    return 16


def _tile_width(page_elems: int, tile: int) -> int:
    """Columns per tile along a row: `tile`, less for pages so small that a tile must fit one."""
    assert tile >= ALIGN and tile & (tile - 1) == 0, f"a tile is a power of two of at least {ALIGN} columns"
    return _fit_page(tile, page_elems)


def _fit_page(width: int, page_elems: int) -> int:
    """A power-of-two tile width halved until a tile lies within a page (pages are multiples of ALIGN)."""
    while width > page_elems:
        width //= 2
    return width


def _choose_split_k(num_tokens: int, block_m: int, programs_per_split: int, in_features: int,
                    device: torch.device, max_split_k: int = _MAX_SPLIT_K) -> int:
    """Splits of the shrink reduction. The fewest programs a step can have (every token on one adapter)
    is cdiv(tokens, block_m) per module and rank block; decode (a handful of tokens per block) needs
    splits to keep the multiprocessors busy, a long prefill none. The interpreter runs programs one by
    one, so there splitting only adds work."""
    if device.type != "cuda":
        return 1
    fewest = max(cdiv(num_tokens, block_m) * programs_per_split, 1)
    target = _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    if fewest >= target:
        return 1
    return max(1, min(cdiv(target, fewest), max_split_k, in_features // _MIN_K_PER_SPLIT))


class _ShrinkPlan(NamedTuple):
    """What both shrinks launch with, after their shared checks."""
    modules: int
    segments: LoraSegments
    split_k: int           # splits launched (none empty)
    k_per_split: int
    block_k: int


def _plan_shrink(x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                 a_offsets: Tensor, max_rank: int, segments: LoraSegments | None, split_k: int | None,
                 max_split_k: int) -> _ShrinkPlan:
    modules = _check_common("x", x, pool, token_slots, page_tables, ranks, a_offsets)
    _check_devices(x, pool, token_slots, page_tables, ranks, a_offsets)
    if max_rank <= 0:
        raise ValueError(f"max_rank must be positive, got {max_rank}")
    num_tokens, in_features = x.shape
    segments = _segments_for(segments, token_slots, num_tokens, page_tables.shape[0], x.device)
    block_k = _tile_width(pool.shape[1], _SHRINK_TILE)
    if split_k is None:
        programs = modules * cdiv(max_rank, _SHRINK_BLOCK_R)
        split_k = _choose_split_k(num_tokens, segments.block_m, programs, in_features, x.device, max_split_k)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    k_per_split = cdiv(cdiv(in_features, split_k), block_k) * block_k
    return _ShrinkPlan(modules, segments, cdiv(in_features, k_per_split), k_per_split, block_k)


def lora_shrink(x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                a_offsets: Tensor, max_rank: int, *, out: Tensor | None = None, partials: bool = False,
                segments: LoraSegments | None = None, split_k: int | None = None, pdl: bool = False) -> Tensor:
    """h[t, m * max_rank + r] = (x[t] @ A_{m,s}ᵀ)[r] for s = token_slots[t] and r below its rank, in one of
    three result forms:

    - default: h itself, `[tokens, modules * max_rank]` in x's dtype (`[tokens, max_rank]` for `[slots]`
      tables), zero for tokens without adapter and columns past a rank.
    - partials=True: the split partial sums, `[splits, tokens, modules * max_rank]` float32, for
      `lora_expand` to add up as it reads them. Only the entries of tokens with an adapter and columns below
      their rank are written; the rest is left as allocated. Summing over the first dimension gives h.
    - out=h: adds into h, float32 `[tokens, modules * max_rank]` zeroed by the caller (the engine zeroes one
      buffer per step for every layer), and returns it. The splits add into h atomically, so expand reads
      one h, and decode can split the reduction finer (up to 32); the float32 sum order of the splits is
      not fixed (results may differ in the last bits between runs).

    x: [tokens, in_features]; pool: [num_pages, page_elems]; token_slots: [tokens] (-1 = no adapter);
    page_tables: [slots, max_pages]; ranks, a_offsets: [slots] for one module, or [modules, slots] for up to
    three modules that read the same x (q/k/v, gate/up): one launch for all, module m's h in columns
    m*max_rank onwards; a_offsets: element offset of A's first row. segments: `lora_segments(token_slots,
    slots)`, computed here when not given. split_k: force the number of splits of the reduction over
    in_features. pdl: launch with programmatic dependent launch (see `check_pdl`), with out= or
    partials=True only."""
    _check_shrink_form(out, partials, pdl)
    check_pdl(pdl, segments, x.device)
    plan = _plan_shrink(x, pool, token_slots, page_tables, ranks, a_offsets, max_rank, segments, split_k,
                        _MAX_SPLIT_K if out is None else _MAX_ACCUMULATE_SPLIT_K)
    operands = (x, pool, plan, page_tables, ranks, a_offsets)
    if out is not None:
        _check_accumulator(out, x, plan.modules * max_rank)
        _launch_shrink(*operands, out, 0, max_rank, accumulate=True, pdl=pdl)
        return out
    h = _partials_buffer(x, plan, max_rank, torch.empty if partials else torch.zeros)
    _launch_shrink(*operands, h, h.stride(0), max_rank, accumulate=False, pdl=pdl)
    return h if partials else h.sum(dim=0).to(x.dtype)


def _check_shrink_form(out: Tensor | None, partials: bool, pdl: bool) -> None:
    if out is not None and partials:
        raise ValueError("lora_shrink takes out= (add into it) or partials=True (return the split sums), not both")
    if pdl and out is None and not partials:
        raise ValueError("pdl=True needs out= or partials=True (the engine's forms); the summed h launches "
                         "without it")


def _check_accumulator(h: Tensor, x: Tensor, width: int) -> None:
    if h.shape != (x.shape[0], width) or h.dtype != torch.float32 or h.stride(1) != 1:
        raise ValueError(f"out: h must be float32 [tokens={x.shape[0]}, modules * max_rank={width}] with "
                         f"stride 1 in its rows, got {h.dtype} of shape {tuple(h.shape)}")
    _check_devices(h, x)


def _partials_buffer(x: Tensor, plan: _ShrinkPlan, max_rank: int, allocate: Callable[..., Tensor]) -> Tensor:
    """`[splits, tokens, modules * max_rank]` float32 for the partial sums. Token rows are padded to a multiple
    of 16, so the split stride is one too whatever the step's size: Triton specialises ints on divisibility by
    16, and a stride that changed it would compile the kernels again."""
    rows = cdiv(x.shape[0], 16) * 16
    return allocate((plan.split_k, rows, plan.modules * max_rank), dtype=torch.float32, device=x.device)[:, :x.shape[0]]


def _launch_shrink(x: Tensor, pool: Tensor, plan: _ShrinkPlan, page_tables: Tensor, ranks: Tensor,
                   a_offsets: Tensor, h: Tensor, stride_hsplit: int, max_rank: int, accumulate: bool,
                   pdl: bool) -> None:
    num_tokens, in_features = x.shape
    if num_tokens == 0 or page_tables.shape[0] == 0:
        return
    rank_blocks = cdiv(max_rank, _SHRINK_BLOCK_R)
    grid = (num_tokens // plan.segments.block_m + page_tables.shape[0], plan.modules * rank_blocks, plan.split_k)
    _lora_shrink_kernel[grid](
        x, pool, plan.segments.token_order, plan.segments.block_slot, plan.segments.block_start,
        plan.segments.block_end, page_tables, ranks, a_offsets, h, in_features, align_up(in_features), max_rank,
        rank_blocks, pool.shape[1], plan.k_per_split, x.stride(0), page_tables.stride(0), _module_stride(ranks),
        _module_stride(a_offsets), stride_hsplit, h.stride(-2),
        BLOCK_M=plan.segments.block_m, BLOCK_R=_SHRINK_BLOCK_R, BLOCK_K=plan.block_k, ALIGN_ELEMS=ALIGN,
        DOT_PRECISION=_dot_precision(x.dtype), ACCUMULATE=accumulate,
        # A split's run of a row must fit in two pages for its page lookups to be hoisted.
        HOIST_PAGES=_HOIST_PAGES and plan.k_per_split <= pool.shape[1], USE_PDL=pdl,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, **launch_options(pdl),
    )


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_partials(h: Tensor, num_tokens: int, modules: int) -> Tensor:
    """h as `[splits, tokens, modules * rank_width]` (a 2-D h is one split)."""
    partials = h.unsqueeze(0) if h.dim() == 2 else h
    if partials.dim() != 3 or partials.shape[1] != num_tokens or partials.stride(2) != 1:
        raise ValueError(f"h must be [tokens={num_tokens}, modules * max_rank] or [splits, tokens, "
                         f"modules * max_rank] with stride 1 in its rows, got shape {tuple(h.shape)}")
    if h.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"h must be float16, bfloat16 or float32, got {h.dtype}")
    if partials.shape[2] % modules != 0:
        raise ValueError(f"h's width {partials.shape[2]} must be a multiple of the {modules} modules")
    return partials


def _check_scalings(scalings: Tensor, ranks: Tensor) -> None:
    if scalings.shape != ranks.shape or not scalings.is_floating_point() or scalings.stride(-1) != 1:
        raise ValueError(f"scalings must be a floating-point tensor shaped like ranks {tuple(ranks.shape)}, "
                         f"got {scalings.dtype} of shape {tuple(scalings.shape)}")


def _split_stride(partials: Tensor) -> int:
    """The stride between splits, 0 for one split (unused then): a constant, so it compiles no new variant."""
    return partials.stride(0) if partials.shape[0] > 1 else 0


def _check_out_sizes(out_sizes: Sequence[int] | None, modules: int, out_features: int) -> list[int]:
    sizes = [out_features] if out_sizes is None and modules == 1 else list(out_sizes or [])
    if len(sizes) != modules or any(n <= 0 for n in sizes) or sum(sizes) != out_features:
        raise ValueError(f"out_sizes must give the positive widths of the {modules} modules' columns, summing to "
                         f"out's {out_features} columns, got {out_sizes}")
    return sizes + [0] * (_MAX_MODULES - modules)


def lora_expand(out: Tensor, h: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                ranks: Tensor, b_offsets: Tensor, scalings: Tensor, *, out_sizes: Sequence[int] | None = None,
                segments: LoraSegments | None = None, pdl: bool = False, gemv: bool = False,
                add: bool = True) -> None:
    """out[t] += (h[t, :r] @ Bᵀ_s) * scaling_s for s = token_slots[t]; tokens with slot -1 untouched.
    add=False: out[t] = (h[t, :r] @ Bᵀ_s) * scaling_s instead (the LoRA delta alone, zeros in a module the
    adapter does not target), so that a later kernel adds it; rows of tokens with slot -1 are not written.

    out: [tokens, out_features] (may be a column slice of a wider output); h: [tokens, modules * width]
    or shrink's partials [splits, tokens, modules * width]; b_offsets: element offset of Bᵀ's first row;
    ranks, b_offsets, scalings: [slots], or [modules, slots] for up to three modules whose outputs lie
    side by side in out, `out_sizes` columns each (q/k/v in the fused qkv output): one launch for all.
    segments: `lora_segments(token_slots, slots)`, computed here when not given.
    pdl: launch with programmatic dependent launch (see `check_pdl`).
    gemv: the one-token kernel: a block of one token (decode with an adapter per request) reads Bᵀ a rank
    row at a time into 1,024-column tiles and sums over the rank within each thread, without tl.dot; a block
    of several tokens runs tl.dot over 128-column parts of its tile."""
    check_pdl(pdl, segments, out.device)
    modules = _check_common("out", out, pool, token_slots, page_tables, ranks, b_offsets)
    partials = _check_partials(h, out.shape[0], modules)
    num_slots = page_tables.shape[0]
    _check_scalings(scalings, ranks)
    sizes = _check_out_sizes(out_sizes, modules, out.shape[1])
    _check_devices(out, h, pool, token_slots, page_tables, ranks, b_offsets, scalings)
    num_tokens = out.shape[0]
    segments = _segments_for(segments, token_slots, num_tokens, num_slots, out.device)
    if num_tokens == 0 or num_slots == 0:
        return
    if partials.shape[2] == 0:   # rank 0 everywhere: the delta is 0
        if not add:
            out[token_slots >= 0] = 0
        return
    if gemv:
        _launch_expand_gemv(out, partials, pool, segments, page_tables, ranks, b_offsets, scalings, sizes, modules,
                            pdl, add)
        return
    block_n = _tile_width(pool.shape[1], _EXPAND_TILE)
    tiles = sum(cdiv(n, block_n) for n in sizes)
    n_tiles = _EXPAND_N_TILES
    tables, strides = _expand_operands(out, partials, pool, segments, page_tables, ranks, b_offsets, scalings, sizes,
                                       modules)
    _lora_expand_kernel[(_expand_blocks(out, segments, page_tables), cdiv(tiles, n_tiles))](
        *tables, tiles, *strides,
        BLOCK_M=segments.block_m, BLOCK_R=16, BLOCK_N=block_n, N_TILES=n_tiles, ALIGN_ELEMS=ALIGN,
        DOT_PRECISION=_dot_precision(out.dtype), USE_PDL=pdl, ADD=add, num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
        **launch_options(pdl),
    )


def _expand_operands(out: Tensor, partials: Tensor, pool: Tensor, segments: LoraSegments, page_tables: Tensor,
                     ranks: Tensor, b_offsets: Tensor, scalings: Tensor, sizes: list[int],
                     modules: int) -> tuple[tuple, tuple]:
    """The expand kernels' shared arguments: (the tensors, sizes and counts before `num_tiles`, which only the
    default kernel takes; page_elems and the strides after it)."""
    tables = (partials, pool, segments.token_order, segments.block_slot, segments.block_start, segments.block_end,
              page_tables, ranks, b_offsets, scalings, out, *sizes, partials.shape[2] // modules, partials.shape[0])
    strides = (pool.shape[1], _split_stride(partials), partials.stride(1), page_tables.stride(0),
               _module_stride(ranks), _module_stride(b_offsets), _module_stride(scalings), out.stride(0))
    return tables, strides


def _expand_blocks(out: Tensor, segments: LoraSegments, page_tables: Tensor) -> int:
    """Programs along the blocks of tokens: the most blocks a step can have, a spare one per slot."""
    return out.shape[0] // segments.block_m + page_tables.shape[0]


def _gemv_max_splits(num_splits: int) -> int:
    """The splits the one-token kernel unrolls: 1, or a power of two from _MAX_SPLIT_K (few variants)."""
    return 1 if num_splits == 1 else max(_MAX_SPLIT_K, 1 << (num_splits - 1).bit_length())


def _launch_expand_gemv(out: Tensor, partials: Tensor, pool: Tensor, segments: LoraSegments, page_tables: Tensor,
                        ranks: Tensor, b_offsets: Tensor, scalings: Tensor, sizes: list[int], modules: int,
                        pdl: bool, add: bool) -> None:
    # 8 columns per thread and row: a row of the tile is one 16-byte load per thread (bf16).
    block_n = _fit_page(LORA_GEMV_TILE, pool.shape[1])
    tiles = sum(cdiv(n, block_n) for n in sizes)
    tables, strides = _expand_operands(out, partials, pool, segments, page_tables, ranks, b_offsets, scalings, sizes,
                                       modules)
    _lora_expand_gemv_kernel[(_expand_blocks(out, segments, page_tables), tiles)](
        *tables, *strides,
        BLOCK_M=segments.block_m, BLOCK_R=16, BLOCK_N=block_n, DOT_N=min(_EXPAND_TILE, block_n), ALIGN_ELEMS=ALIGN,
        DOT_PRECISION=_dot_precision(out.dtype), USE_PDL=pdl, MAX_SPLITS=_gemv_max_splits(partials.shape[0]), ADD=add,
        num_warps=_GEMV_WARPS, num_stages=_NUM_STAGES,
        **launch_options(pdl),
    )
