"""Builders of random kernel inputs in the unified pool layout (DESIGN §2).

Every pool starts filled with NaN and only the elements a kernel may read are written with random
values, so a kernel that reads past a context length, past an adapter's rank, into the alignment
padding of a row or through an unused block-table entry produces NaN and fails its test. Page 0 is
never handed out and padding entries of block/page tables point at it.
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from slora.kernels import reference
from slora.kernels.layout import align_up


def has_pdl() -> bool:
    """Whether this machine can run the kernels with programmatic dependent launch (GPU tests skip otherwise)."""
    from slora.kernels.pdl import pdl_supported
    return torch.cuda.is_available() and pdl_supported(torch.device("cuda"))


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> Tensor:
    """Random normal tensor drawn on the CPU (reproducible), then moved."""
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def nan_pool(num_pages: int, page_elems: int, dtype: torch.dtype, device: str = "cpu") -> Tensor:
    return torch.full((num_pages, page_elems), float("nan"), dtype=dtype, device=device)


@dataclass
class PagedKV:
    kv_pool: Tensor        # [num_pages, 2 * page_size * num_kv_heads * head_dim]
    block_tables: Tensor   # [batch, max_blocks] int32, padding entries = 0 (the NaN page)
    context_lens: Tensor   # [batch] int32


def make_paged_kv(context_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, gen: torch.Generator, device: str = "cpu",
                  extra_blocks: int = 1) -> PagedKV:
    """A pool holding random K/V for sequences of the given lengths on randomly permuted pages.

    Slots past each sequence's length stay NaN. `extra_blocks` padding columns are added to the block
    table so kernels cannot infer lengths from its width."""
    blocks = [-(-n // page_size) for n in context_lens]
    num_pages = 1 + sum(blocks)
    page_elems = 2 * page_size * num_kv_heads * head_dim
    pool = nan_pool(num_pages, page_elems, dtype)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 stays unused
    max_blocks = max(blocks, default=0) + extra_blocks
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    pages = pool.view(num_pages, 2, page_size, num_kv_heads, head_dim)
    for b, (n, nb) in enumerate(zip(context_lens, blocks)):
        ids, perm = perm[:nb], perm[nb:]
        tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(n)
        page_of = torch.tensor(ids, dtype=torch.long)[pos // page_size]
        pages[page_of, :, pos % page_size] = randn((n, 2, num_kv_heads, head_dim), dtype, gen)
    return PagedKV(pool.to(device), tables.to(device), torch.tensor(context_lens, dtype=torch.int32, device=device))


def take_new_kv(kv_pool: Tensor, block_tables: Tensor, cases: list[tuple[int, int]], page_size: int,
                num_kv_heads: int, keep_first: int = 0) -> tuple[Tensor, Tensor]:
    """The new tokens' K and V `[new tokens, kv_heads, head_dim]` of sequences of (cached prefix, new tokens)
    out of the pool; their copies there are then overwritten with NaN (a kernel that reads them there
    fails), except those of the first `keep_first` sequences."""
    from slora.kernels import reference
    pages = reference.kv_page_view(kv_pool, page_size, num_kv_heads)   # [pages, 2, page_size, kv_heads, hd]
    keys, values = [], []
    for seq, (prefix, new) in enumerate(cases):
        pos = torch.arange(prefix, prefix + new, device=kv_pool.device)
        page = block_tables[seq].long()[pos // page_size]
        keys.append(pages[page, 0, pos % page_size].clone())
        values.append(pages[page, 1, pos % page_size].clone())
        if seq >= keep_first:
            pages[page, :, pos % page_size] = float("nan")
    return torch.cat(keys), torch.cat(values)


@dataclass
class LoraBatch:
    """Tables are `[slots]` for one module, `[modules, slots]` for fused modules (q/k/v side by side)."""
    pool: Tensor          # [num_pages, page_elems], NaN outside the adapters' rows
    page_tables: Tensor   # [slots, max_pages] int32, padding entries = 0 (the NaN page)
    ranks: Tensor         # int32
    a_offsets: Tensor     # int64, element offset of A's first row in the logical buffer
    b_offsets: Tensor     # int64, element offset of Bᵀ's first row
    scalings: Tensor      # float32


def make_lora_batch(ranks: list[int], in_features: int, out_features: int, page_elems: int,
                    dtype: torch.dtype, gen: torch.Generator, device: str = "cpu",
                    weight_scale: float = 0.1) -> LoraBatch:
    """One module's random A / Bᵀ per slot (rank 0 = slot without this module) in a NaN pool."""
    fused = make_fused_lora_batch([ranks], in_features, [out_features], page_elems, dtype, gen, device,
                                  weight_scale)
    return LoraBatch(fused.pool, fused.page_tables, fused.ranks[0], fused.a_offsets[0], fused.b_offsets[0],
                     fused.scalings[0])


def make_fused_lora_batch(module_ranks: list[list[int]], in_features: int, out_sizes: list[int],
                          page_elems: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu",
                          weight_scale: float = 0.1) -> LoraBatch:
    """Pack random A / Bᵀ of several modules that share an input (module m: `module_ranks[m][slot]`,
    `out_sizes[m]` outputs) into a NaN pool, one logical buffer per slot.

    Each buffer starts with a random multiple of ALIGN of other data (as if earlier modules were packed
    first), holds the modules one after another, and is split over randomly permuted, non-contiguous
    pages."""
    assert page_elems % align_up(1) == 0, "page_elems must be a multiple of ALIGN"
    num_slots = len(module_ranks[0])
    layouts = [_slot_layout([m[s] for m in module_ranks], in_features, out_sizes,
                            align_up(1) * int(torch.randint(0, 4, (1,), generator=gen))) for s in range(num_slots)]
    pages_per_slot = [max(1, -(-total // page_elems)) for _, total in layouts]
    # Twice the needed pages, so the ones in use are scattered among unused (NaN) ones.
    num_pages = 1 + 2 * sum(pages_per_slot)
    pool = nan_pool(num_pages, page_elems, dtype)
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(num_slots, max(pages_per_slot), dtype=torch.int32)
    for s, (offsets, _) in enumerate(layouts):
        ids, free = free[:pages_per_slot[s]], free[pages_per_slot[s]:]
        tables[s, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for ranks, (a_off, b_off), out_features in zip(module_ranks, offsets, out_sizes):
            _write_rows(pool, ids, a_off, randn((ranks[s], in_features), dtype, gen) * weight_scale)
            _write_rows(pool, ids, b_off, randn((ranks[s], out_features), dtype, gen) * weight_scale)
    offsets = torch.tensor([o for o, _ in layouts], dtype=torch.int64).permute(1, 0, 2)   # [modules, slots, 2]
    scalings = torch.rand(len(module_ranks), num_slots, generator=gen) + 0.5
    return LoraBatch(pool.to(device), tables.to(device), torch.tensor(module_ranks, dtype=torch.int32, device=device),
                     offsets[..., 0].contiguous().to(device), offsets[..., 1].contiguous().to(device),
                     scalings.to(device))


def _slot_layout(ranks: list[int], in_features: int, out_sizes: list[int],
                 lead: int) -> tuple[list[tuple[int, int]], int]:
    """((a_offset, b_offset) per module, total elements) of one slot's buffer after `lead` other elements."""
    offsets, cursor = [], lead
    for rank, out_features in zip(ranks, out_sizes):
        b_offset = cursor + rank * align_up(in_features)
        offsets.append((cursor, b_offset))
        cursor = b_offset + rank * align_up(out_features)
    return offsets, cursor


def _write_rows(pool: Tensor, page_ids: list[int], offset: int, rows: Tensor) -> None:
    """Write rows of a matrix into a logical buffer at `offset`, each row at a multiple of ALIGN."""
    page_elems = pool.shape[1]
    num_rows, row_len = rows.shape
    elems = offset + torch.arange(num_rows)[:, None] * align_up(row_len) + torch.arange(row_len)[None, :]
    pool[torch.tensor(page_ids, dtype=torch.long)[elems // page_elems], elems % page_elems] = rows


def random_token_slots(num_tokens: int, num_slots: int, gen: torch.Generator, no_adapter_frac: float = 0.25,
                       device: str = "cpu") -> Tensor:
    """int32 [num_tokens] slots in [-1, num_slots), about `no_adapter_frac` of them -1."""
    slots = torch.randint(0, num_slots, (num_tokens,), generator=gen)
    none = torch.rand(num_tokens, generator=gen) < no_adapter_frac
    return slots.masked_fill(none, -1).to(torch.int32).to(device)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """atol/rtol for comparing a kernel in `dtype` with the torch reference."""
    return {torch.float32: {"atol": 1e-4, "rtol": 1e-4},
            torch.float16: {"atol": 1e-2, "rtol": 1e-2},
            torch.bfloat16: {"atol": 5e-2, "rtol": 3e-2}}[dtype]


def assert_close(actual: Tensor, expected: Tensor) -> None:
    """Compare in float32 with the tolerance of `actual`'s dtype; NaN never passes."""
    assert not torch.isnan(actual).any(), "kernel output holds NaN (read outside the valid data?)"
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance(actual.dtype))


def fp8_cache(kv_pool: Tensor, page_size: int, num_kv_heads: int, scales: str | None, halves: bool,
           gen: torch.Generator) -> tuple[Tensor, Tensor | None]:
    """(pool, kv_scales): kv_pool's K/V as the engine may keep them. scales "pow2" (the engine's calibrated
    ones) or "any": quantized to FP8 by random per-head scales. halves: as the page view `[num_pages, 2,
    page_size, num_kv_heads, head_dim]` of a layer holding every page's K, then every page's V."""
    kv_scales = None
    if scales == "pow2":
        kv_scales = 2.0 ** torch.randint(-7, -2, (2, num_kv_heads), generator=gen).float()
    elif scales == "any":
        kv_scales = torch.rand(2, num_kv_heads, generator=gen) * 0.05 + 0.005
    pages = reference.kv_page_view(kv_pool, page_size, num_kv_heads)   # [pages, 2, page_size, kv_heads, hd]
    if kv_scales is not None:
        kv_scales = kv_scales.to(kv_pool.device)
        pages = reference.quantize_fp8(pages, kv_scales[None, :, None, :, None])
    if halves:
        return pages.transpose(0, 1).contiguous().transpose(0, 1), kv_scales
    return pages.reshape(kv_pool.shape), kv_scales
