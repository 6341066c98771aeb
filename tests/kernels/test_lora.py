"""lora_shrink / lora_expand (Triton) against the torch reference."""
import pytest
import torch
from kernel_helpers import (
    assert_close,
    has_pdl,
    make_fused_lora_batch,
    make_generator,
    make_lora_batch,
    randn,
    random_token_slots,
)

from slora.kernels import lora, reference
from slora.kernels.lora import (
    lora_expand,
    lora_segments,
    lora_shrink,
)


def _decode_slots(num_slots: int, gen: torch.Generator) -> torch.Tensor:
    # One token per slot in random order, plus two tokens without adapter.
    slots = torch.cat([torch.randperm(num_slots, generator=gen), torch.tensor([-1, -1])])
    return slots[torch.randperm(len(slots), generator=gen)].to(torch.int32)


def _prefill_slots(num_slots: int, gen: torch.Generator) -> torch.Tensor:
    # Segments of different lengths (one longer than a 16-token block), interleaved with slot -1 tokens.
    lengths = [1, 17, 5, 3, 9, 2][:num_slots]
    slots = [s for s, n in enumerate(lengths) for _ in range(n)] + [-1] * 4
    return torch.tensor(slots, dtype=torch.int32)[torch.randperm(len(slots), generator=gen)]


SLOT_PATTERNS = {"decode": _decode_slots, "prefill": _prefill_slots}


def _set_launch_constants(monkeypatch, tile=None, n_tiles=None, hoist_pages=None):
    """The kernels' private launch constants, moved to reach their other paths (None: left as they are)."""
    for name, value in (("_SHRINK_TILE", tile), ("_EXPAND_TILE", tile), ("_EXPAND_N_TILES", n_tiles),
                        ("_HOIST_PAGES", hoist_pages)):
        if value is not None:
            monkeypatch.setattr(lora, name, value)
RANKS = [1, 3, 8, 16, 0, 5]   # rank 0 = the adapter does not target this module


def _shrink_case(dtype, pattern, in_features, seed, ranks=RANKS, max_rank=16, device="cpu"):
    gen = make_generator(seed)
    batch = make_lora_batch(ranks, in_features, 8, 512, dtype, gen, device)
    slots = SLOT_PATTERNS[pattern](len(ranks), gen).to(device)
    x = randn((len(slots), in_features), dtype, gen, device)
    return x, batch, slots, max_rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", ["decode", "prefill"])
@pytest.mark.parametrize("in_features", [96, 200])   # not multiples of ALIGN: rows have padding
@pytest.mark.parametrize("split_k", [None, 2])
def test_lora_shrink_matches_reference(dtype, pattern, in_features, split_k):
    x, b, slots, max_rank = _shrink_case(dtype, pattern, in_features, seed=in_features)
    got = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, max_rank, split_k=split_k)
    want = reference.lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, max_rank)
    assert got.shape == (len(slots), max_rank) and got.dtype == dtype
    assert want.abs().sum() > 0
    assert_close(got, want)


def _expand_case(dtype, pattern, out_features, seed, ranks=RANKS, max_rank=16, device="cpu"):
    gen = make_generator(seed)
    batch = make_lora_batch(ranks, 8, out_features, 512, dtype, gen, device)
    slots = SLOT_PATTERNS[pattern](len(ranks), gen).to(device)
    # h is random past each slot's rank too: reading it there would change the result.
    h = randn((len(slots), max_rank), dtype, gen, device)
    # out as a column slice of a wider fused output, like q inside qkv.
    wide = randn((len(slots), out_features + 24), dtype, gen, device)
    return wide[:, 8:8 + out_features], h, batch, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", ["decode", "prefill"])
@pytest.mark.parametrize("out_features", [72, 160])
def test_lora_expand_matches_reference(dtype, pattern, out_features):
    out, h, b, slots = _expand_case(dtype, pattern, out_features, seed=out_features)
    want = out.clone()
    reference.lora_expand(want, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings)
    before = out.clone()
    lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings)
    assert_close(out, want)
    untouched = (slots < 0) | (b.ranks[slots.long().clamp(min=0)] == 0)
    assert torch.equal(out[untouched], before[untouched])


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("pattern", ["random", "one token per slot"])
def test_lora_ranks_up_to_64_with_shared_segments(gemv, pattern):
    ranks = [64, 1, 33, 0, 16]
    gen = make_generator(11)
    b = make_lora_batch(ranks, 72, 136, 1024, torch.float32, gen)
    slots = random_token_slots(24, len(ranks), gen) if pattern == "random" else _decode_slots(len(ranks), gen)
    segments = lora_segments(slots, len(ranks))
    x = randn((len(slots), 72), torch.float32, gen)
    h = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 64, segments=segments)
    assert_close(h, reference.lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 64))
    out = randn((len(slots), 136), torch.float32, gen)
    want = out.clone()
    reference.lora_expand(want, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings)
    lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, segments=segments, gemv=gemv)
    assert_close(out, want)


@pytest.mark.parametrize("page_elems", [64, 128, 1024])
@pytest.mark.parametrize("hoist_pages", [False, True])   # runs longer than a page fall back to the loop's lookups
@pytest.mark.parametrize("tile", [64, None])
def test_lora_small_and_large_pages(monkeypatch, page_elems, hoist_pages, tile):
    # Pages of one or two ALIGN rows force narrow tiles; large pages let 128-wide tiles cross page
    # boundaries (the page chosen per column), and 64-wide tiles choose theirs per row and read the rows'
    # NaN padding past 136 and 200 columns, which must not reach the result.
    _set_launch_constants(monkeypatch, tile=tile, hoist_pages=hoist_pages)
    ranks = [2, 16, 5]
    gen = make_generator(page_elems)
    b = make_lora_batch(ranks, 136, 200, page_elems, torch.float32, gen)
    slots = random_token_slots(21, len(ranks), gen)
    x = randn((21, 136), torch.float32, gen)
    h = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16)
    assert_close(h, reference.lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16))
    out = randn((21, 200), torch.float32, gen)
    want = out.clone()
    reference.lora_expand(want, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings)
    lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings)
    assert_close(out, want)


@pytest.mark.parametrize("page_elems", [64, 192, 1024])
@pytest.mark.parametrize("pattern", ["decode", "prefill"])
def test_one_token_expand_on_narrow_pages(page_elems, pattern):
    """lora_expand(gemv=True) on pages narrower than its 1,024-column tile, 192 not a power of two: the tile
    shrinks to fit a page, rows still cross pages (200 columns) and the NaN padding stays out."""
    gen = make_generator(page_elems + 1)
    b = make_lora_batch(RANKS, 72, 200, page_elems, torch.float32, gen)
    slots = SLOT_PATTERNS[pattern](len(RANKS), gen)
    h = randn((len(slots), 16), torch.float32, gen)
    out = randn((len(slots), 200), torch.float32, gen)
    want = out.clone()
    reference.lora_expand(want, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings)
    lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, gemv=True)
    assert_close(out, want)


# Fused modules: q/k/v-like (three outputs, widths not multiples of a tile) and gate/up-like (two).
# Each module has its own ranks per slot, rank 0 where an adapter does not target that module.
FUSED_CASES = {
    "qkv": ([[1, 3, 8, 16, 0, 5], [16, 0, 2, 8, 4, 5], [7, 3, 0, 16, 1, 0]], [96, 40, 40]),
    "gate_up": ([[8, 16, 0, 4, 2, 9], [8, 1, 6, 0, 2, 9]], [136, 136]),
}


def _fused_case(dtype, pattern, name, seed, device="cpu"):
    module_ranks, out_sizes = FUSED_CASES[name]
    gen = make_generator(seed)
    batch = make_fused_lora_batch(module_ranks, 300, out_sizes, 512, dtype, gen, device)
    slots = SLOT_PATTERNS[pattern](len(module_ranks[0]), gen).to(device)
    x = randn((len(slots), 300), dtype, gen, device)   # 3 tiles of 128: room for 3 splits
    out = randn((len(slots), sum(out_sizes)), dtype, gen, device)
    return x, out, batch, slots, out_sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", ["decode", "prefill"])
@pytest.mark.parametrize("name", sorted(FUSED_CASES))
@pytest.mark.parametrize("split_k,n_tiles,tile,gemv", [(1, 1, None, False), (3, 2, 64, False), (2, 4, 256, False),
                                                      (1, 1, None, True), (2, 1, None, True)])
def test_fused_modules_match_reference(monkeypatch, dtype, pattern, name, split_k, n_tiles, tile, gemv):
    _set_launch_constants(monkeypatch, tile=tile, n_tiles=n_tiles)
    x, out, b, slots, out_sizes = _fused_case(dtype, pattern, name, seed=split_k)
    h_want = reference.lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16)
    partials = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, partials=True,
                           split_k=split_k)
    assert partials.shape == (split_k, len(slots), len(out_sizes) * 16)
    assert_close(lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, split_k=split_k), h_want)
    want = out.clone()
    reference.lora_expand(want, h_want, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, out_sizes)
    # Expand straight from the partial sums. Shrink leaves the entries of tokens without adapter and of
    # columns past each rank unwritten: make them NaN, so that reading one fails the test.
    lora_expand(out, _unwritten_as_nan(partials, slots, b.ranks, 16), b.pool, slots, b.page_tables, b.ranks,
                b.b_offsets, b.scalings, out_sizes=out_sizes, gemv=gemv)
    assert_close(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", ["decode", "prefill"])
@pytest.mark.parametrize("name", sorted(FUSED_CASES))
@pytest.mark.parametrize("split_k,gemv,n_tiles,tile", [(1, False, 1, None), (2, False, 2, 64), (1, False, 4, 256),
                                                      (1, True, 1, None), (2, True, 1, None)])
def test_expand_without_add_writes_the_delta(monkeypatch, dtype, pattern, name, split_k, gemv, n_tiles, tile):
    """add=False: rows of tokens with an adapter hold the delta alone, zeros in modules of rank 0 (out starts
    random, so a tile left unwritten fails); rows of tokens without adapter keep what they held. Several
    tiles per program: the last program has tiles past the last one, which must write nothing."""
    _set_launch_constants(monkeypatch, tile=tile, n_tiles=n_tiles)
    x, out, b, slots, out_sizes = _fused_case(dtype, pattern, name, seed=10 + split_k)
    partials = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, partials=True,
                           split_k=split_k)
    h = reference.lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16)
    want = torch.zeros_like(out)
    reference.lora_expand(want, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, out_sizes)
    without = slots < 0
    want[without] = out[without]
    lora_expand(out, _unwritten_as_nan(partials, slots, b.ranks, 16), b.pool, slots, b.page_tables, b.ranks,
                b.b_offsets, b.scalings, out_sizes=out_sizes, gemv=gemv, add=False)
    assert_close(out, want)
    ranks_of_tokens = b.ranks[:, slots[~without].long()]             # [modules, tokens with an adapter]
    assert (ranks_of_tokens == 0).any(), "the case must have modules an adapter does not target"


def test_reference_expand_without_add_matches_adding_into_zeros():
    x, out, b, slots, out_sizes = _fused_case(torch.float32, "prefill", "qkv", seed=3)
    h = reference.lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16)
    added = torch.zeros_like(out)
    reference.lora_expand(added, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, out_sizes)
    before = out.clone()
    reference.lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, out_sizes,
                          add=False)
    with_adapter = slots >= 0
    assert torch.equal(out[with_adapter], added[with_adapter])
    assert torch.equal(out[~with_adapter], before[~with_adapter])


@pytest.mark.parametrize("gemv", [False, True])
def test_expand_without_add_of_rank_zero_h_writes_zeros(gemv):
    """h of width 0 (every rank 0): the delta is 0 in the rows of tokens with an adapter, the rest untouched."""
    x, out, b, slots, out_sizes = _fused_case(torch.float32, "prefill", "qkv", seed=4)
    before = out.clone()
    lora_expand(out, torch.empty(len(slots), 0), b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings,
                out_sizes=out_sizes, gemv=gemv, add=False)
    with_adapter = slots >= 0
    assert torch.equal(out[with_adapter], torch.zeros_like(out[with_adapter]))
    assert torch.equal(out[~with_adapter], before[~with_adapter])


def _unwritten_as_nan(partials, slots, ranks, max_rank):
    """partials [splits, tokens, modules * max_rank] with NaN wherever shrink writes nothing."""
    token_ranks = torch.where(slots[None, :] >= 0, ranks[:, slots.long().clamp(min=0)], 0)   # [modules, tokens]
    written = torch.arange(max_rank)[None, None, :] < token_ranks[:, :, None]                  # [modules, tokens, r]
    written = written.permute(1, 0, 2).reshape(len(slots), -1)                                   # [tokens, modules * r]
    return torch.where(written[None], partials, float("nan"))


def test_fused_expand_rejects_bad_out_sizes():
    x, out, b, slots, out_sizes = _fused_case(torch.float32, "decode", "qkv", seed=5)
    h = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16)
    for sizes in (None, out_sizes[:2], [96, 40, 41]):
        with pytest.raises(ValueError, match="out_sizes"):
            lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, out_sizes=sizes)
    with pytest.raises(ValueError, match="offsets must have the shape of ranks"):
        lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets[0], 16)


def test_lora_segments_group_tokens_by_slot():
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0] + [1] * 17, dtype=torch.int32)
    order, starts, block_slot, block_start, block_end, block_m = lora_segments(slots, 4)
    assert block_m == 16
    assert starts.tolist() == [2, 4, 21, 24, 24]
    assert order.tolist()[:2] == [1, 5] and order.tolist()[2:4] == [2, 6] and order.tolist()[21:] == [0, 3, 4]
    # Blocks (24 // 16 + 4 = 5): slot 0 from token 2, slot 1 in two blocks, slot 2, slot 3 (empty).
    assert block_slot.tolist() == [0, 1, 1, 2, 3]
    assert block_start.tolist() == [2, 4, 20, 21, 24]
    assert block_end.tolist() == [4, 20, 21, 24, 24]   # the last block is spare


def test_lora_without_adapters_is_a_no_op():
    x, b, _, max_rank = _shrink_case(torch.float32, "decode", 64, seed=12)
    slots = torch.full((x.shape[0],), -1, dtype=torch.int32)
    h = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, max_rank)
    assert torch.equal(h, torch.zeros_like(h))
    out = randn((x.shape[0], 8), torch.float32, make_generator(0))
    before = out.clone()
    lora_expand(out, randn(tuple(h.shape), torch.float32, make_generator(1)), b.pool, slots, b.page_tables,
                b.ranks, b.b_offsets, b.scalings)
    assert torch.equal(out, before)


@pytest.mark.parametrize("changes,match", [
    (lambda a: {"x": a["x"][0]}, "x must be"),
    (lambda a: {"x": a["x"].t().contiguous().t()}, "stride 1"),
    (lambda a: {"token_slots": a["token_slots"][:-1]}, "token_slots must be"),
    (lambda a: {"page_tables": a["page_tables"].float()}, "int32 or int64"),
    (lambda a: {"ranks": a["ranks"][:-1]}, "ranks must be"),
    (lambda a: {"pool": a["pool"][:, :100].contiguous()}, "multiple of ALIGN"),
    (lambda a: {"max_rank": 0}, "max_rank"),
    (lambda a: {"segments": lora_segments(a["token_slots"][:-1], 6)}, "segments"),
    # Page tables spanning 2**31 elements (the kernels index an adapter's elements in int32); one row, broadcast.
    (lambda a: {"page_tables": torch.zeros(1, 2 ** 31 // a["pool"].shape[1], dtype=torch.int32).expand(6, -1)},
     r"2\*\*31"),
])
def test_lora_shrink_rejects_bad_input(changes, match):
    x, b, slots, max_rank = _shrink_case(torch.float32, "decode", 64, seed=13)
    args = {"x": x, "pool": b.pool, "token_slots": slots, "page_tables": b.page_tables, "ranks": b.ranks,
                "a_offsets": b.a_offsets, "max_rank": max_rank}
    args.update(changes(args))
    with pytest.raises(ValueError, match=match):
        lora_shrink(**args)


@pytest.mark.parametrize("changes,match", [
    (lambda a: {"h": a["h"][:-1]}, "h must be"),
    (lambda a: {"scalings": a["scalings"][:-1]}, "scalings must be"),
    (lambda a: {"b_offsets": a["b_offsets"].float()}, "int32 or int64"),
    (lambda a: {"out": a["out"].to(torch.int32)}, "float16, bfloat16 or float32"),
])
def test_lora_expand_rejects_bad_input(changes, match):
    out, h, b, slots = _expand_case(torch.float32, "decode", 72, seed=14)
    args = {"out": out, "h": h, "pool": b.pool, "token_slots": slots, "page_tables": b.page_tables, "ranks": b.ranks,
                "b_offsets": b.b_offsets, "scalings": b.scalings}
    args.update(changes(args))
    with pytest.raises(ValueError, match=match):
        lora_expand(**args)


GPU_RANKS = [16, 128, 1, 64, 8, 0, 32, 16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [64, 2000])
@pytest.mark.parametrize("in_features,out_features", [(4096, 1024), (14336, 4096)])
def test_lora_gpu(dtype, num_tokens, in_features, out_features):
    gen = make_generator(num_tokens)
    b = make_lora_batch(GPU_RANKS, in_features, out_features, 2 * 16 * 8 * 128, dtype, gen, "cuda",
                        weight_scale=0.02)
    slots = random_token_slots(num_tokens, len(GPU_RANKS), gen, device="cuda")
    x = randn((num_tokens, in_features), dtype, gen, "cuda")
    # Compare with the reference in float32: both accumulate in float32, the bf16 reference would not.
    h = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 128)
    h_want = reference.lora_shrink(x.float(), b.pool.float(), slots, b.page_tables, b.ranks, b.a_offsets, 128)
    assert_close(h, h_want)
    out = randn((num_tokens, out_features), dtype, gen, "cuda")
    want = out.float()
    reference.lora_expand(want, h.float(), b.pool.float(), slots, b.page_tables, b.ranks, b.b_offsets, b.scalings)
    lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings)
    assert_close(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [64, 1000])
@pytest.mark.parametrize("gemv", [False, True])
def test_fused_qkv_gpu(dtype, num_tokens, gemv):
    gen = make_generator(num_tokens + 1)
    module_ranks = [GPU_RANKS, GPU_RANKS[::-1], GPU_RANKS[2:] + GPU_RANKS[:2]]
    out_sizes = [4096, 1024, 1024]
    b = make_fused_lora_batch(module_ranks, 4096, out_sizes, 2 * 16 * 8 * 128, dtype, gen, "cuda", weight_scale=0.02)
    slots = random_token_slots(num_tokens, len(GPU_RANKS), gen, device="cuda")
    x = randn((num_tokens, 4096), dtype, gen, "cuda")
    partials = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 128, partials=True)
    h_want = reference.lora_shrink(x.float(), b.pool.float(), slots, b.page_tables, b.ranks, b.a_offsets, 128)
    out = randn((num_tokens, sum(out_sizes)), dtype, gen, "cuda")
    want = out.float()
    reference.lora_expand(want, h_want, b.pool.float(), slots, b.page_tables, b.ranks, b.b_offsets, b.scalings,
                          out_sizes)
    lora_expand(out, partials, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, out_sizes=out_sizes,
                gemv=gemv)
    assert_close(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_expand_one_token_per_adapter_gpu(dtype):
    """A decode step with an adapter per request (the gemv kernel's one-token blocks), Llama-3-8B's gate/up
    sizes, ranks up to 128 and pages scattered, against the float32 reference."""
    gen = make_generator(83)
    ranks = (GPU_RANKS * 8)[:64]
    out_sizes = [14336, 14336]
    b = make_fused_lora_batch([ranks, ranks[::-1]], 4096, out_sizes, 2 * 16 * 8 * 128, dtype, gen, "cuda",
                              weight_scale=0.02)
    slots = torch.randperm(64, generator=gen).to(torch.int32).cuda()
    h = randn((64, 2 * 128), torch.float32, gen, "cuda")
    out = randn((64, sum(out_sizes)), dtype, gen, "cuda")
    want = out.float()
    reference.lora_expand(want, h.to(dtype).float(), b.pool.float(), slots, b.page_tables, b.ranks, b.b_offsets,
                          b.scalings, out_sizes)
    lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, out_sizes=out_sizes, gemv=True)
    assert_close(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", ["decode", "prefill"])
@pytest.mark.parametrize("name", sorted(FUSED_CASES))
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("hoist_pages", [False, True])
@pytest.mark.parametrize("tile", [64, 128])
def test_shrink_into_adds_every_split_into_h(monkeypatch, dtype, pattern, name, split_k, hoist_pages, tile):
    _set_launch_constants(monkeypatch, tile=tile, hoist_pages=hoist_pages)
    x, out, b, slots, out_sizes = _fused_case(dtype, pattern, name, seed=7 + split_k)
    h_want = reference.lora_shrink(x.float(), b.pool.float(), slots, b.page_tables, b.ranks, b.a_offsets, 16)
    start = randn(tuple(h_want.shape), torch.float32, make_generator(3))
    h = start.clone()                      # not zero: the shrink must add to what h holds
    lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, out=h, split_k=split_k)
    assert_close(h, start + h_want)
    want = out.float()
    reference.lora_expand(want, h_want, b.pool.float(), slots, b.page_tables, b.ranks, b.b_offsets, b.scalings,
                          out_sizes)
    lora_expand(out, h - start, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, out_sizes=out_sizes)
    assert_close(out, want)


def test_shrink_into_rejects_bad_input():
    x, _, b, slots, _ = _fused_case(torch.float32, "decode", "qkv", seed=8)
    for h in (torch.zeros(len(slots), 47), torch.zeros(len(slots), 48, dtype=torch.float16),
              torch.zeros(1, len(slots), 48), torch.zeros(len(slots), 96)[:, ::2]):
        with pytest.raises(ValueError, match="h must be float32"):
            lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, out=h)
    h = torch.zeros(len(slots), 48)
    with pytest.raises(ValueError, match="split_k"):
        lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, out=h, split_k=0)
    with pytest.raises(ValueError, match="max_rank"):
        lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 0, out=h)
    with pytest.raises(ValueError, match="no features"):
        lora_shrink(x[:, :0], b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, out=h)


def test_shrink_result_forms():
    # out= is returned; out= with partials=True, and pdl without either (the summed h), are refused.
    x, _, b, slots, _ = _fused_case(torch.float32, "decode", "qkv", seed=8)
    h = torch.zeros(len(slots), 48)
    assert lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, out=h) is h
    with pytest.raises(ValueError, match="not both"):
        lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, out=h, partials=True)
    segments = lora_segments(slots, b.page_tables.shape[0])
    with pytest.raises(ValueError, match="pdl=True needs out= or partials=True"):
        lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 16, segments=segments, pdl=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [None, 32])
@pytest.mark.parametrize("in_features", [4096, 14336])
@pytest.mark.parametrize("hoist_pages", [False, True])
def test_shrink_into_gpu(monkeypatch, dtype, split_k, in_features, hoist_pages):
    # The engine's shrink for steps of up to 64 tokens, at Llama-3-8B sizes: the automatic split (many
    # splits added atomically) and the most splits.
    _set_launch_constants(monkeypatch, hoist_pages=hoist_pages)
    gen = make_generator(in_features + (split_k or 0))
    module_ranks = [GPU_RANKS, GPU_RANKS[::-1]]
    b = make_fused_lora_batch(module_ranks, in_features, [4096, 4096], 2 * 16 * 8 * 128, dtype, gen, "cuda",
                              weight_scale=0.02)
    slots = random_token_slots(64, len(GPU_RANKS), gen, device="cuda")
    x = randn((64, in_features), dtype, gen, "cuda")
    h = torch.zeros(64, 2 * 128, dtype=torch.float32, device="cuda")
    lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 128, out=h, split_k=split_k)
    want = reference.lora_shrink(x.float(), b.pool.float(), slots, b.page_tables, b.ranks, b.a_offsets, 128)
    assert_close(h, want)


def test_pdl_needs_segments_and_a_gpu():
    x, b, slots, max_rank = _shrink_case(torch.float32, "decode", 96, seed=7)
    h = torch.zeros(x.shape[0], max_rank)
    with pytest.raises(ValueError, match="segments computed beforehand"):
        lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, max_rank, out=h, pdl=True)
    segments = lora_segments(slots, b.page_tables.shape[0])
    with pytest.raises(ValueError, match="compute capability 9.0"):
        lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, max_rank, out=h, segments=segments,
                    pdl=True)
    out = torch.zeros(x.shape[0], 8)
    with pytest.raises(ValueError, match="segments computed beforehand"):
        lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, pdl=True)
    with pytest.raises(ValueError, match="compute capability 9.0"):
        lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, segments=segments,
                    pdl=True)


@pytest.mark.gpu
@pytest.mark.skipif(not has_pdl(), reason="needs a CUDA GPU of compute capability 9.0+")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,split_k", [(64, None), (128, 4), (1000, None)])   # one h; partial sums
@pytest.mark.parametrize("shared", [True, False])
def test_pdl_launches_in_a_graph_gpu(dtype, num_tokens, split_k, shared):
    # As the engine's decode graphs run them: x made by the kernel just before, then the base GEMM, then
    # shrink and expand with programmatic dependent launch (each may start before the previous kernel
    # ends), then the rotary kernel with it too, then an ordinary kernel. Replayed with new x: the kernels
    # must read x, h and out only after the kernels that write them have finished.
    from slora.kernels.fused_ops import rotary_qk_
    gen = make_generator(num_tokens + shared)
    module_ranks = [GPU_RANKS, GPU_RANKS[::-1], GPU_RANKS[2:] + GPU_RANKS[:2]]
    out_sizes = [4096, 1024, 1024]
    b = make_fused_lora_batch(module_ranks, 4096, out_sizes, 2 * 16 * 8 * 128, dtype, gen, "cuda", weight_scale=0.02)
    slots = (torch.zeros(num_tokens, dtype=torch.int32, device="cuda") + 1 if shared
             else random_token_slots(num_tokens, len(GPU_RANKS), gen, device="cuda"))
    segments = lora_segments(slots, len(GPU_RANKS))
    weight = randn((sum(out_sizes), 4096), dtype, gen, "cuda") / 64
    source = randn((num_tokens, 4096), dtype, gen, "cuda")
    # Rotation by angle 0: the rotary kernel returns its input exactly, so the result is the LoRA output,
    # but it still reads it with PDL after the expand (a read before the expand ends would miss the LoRA).
    # Random angles put single bf16 elements past the tolerance on the H200 (rounding in the rotary).
    cos = torch.ones(num_tokens, 128, dtype=dtype, device="cuda")
    sin = torch.zeros(num_tokens, 128, dtype=dtype, device="cuda")

    def step() -> torch.Tensor:
        x = source * 2                                         # [tokens, 4096], written just before
        out = x @ weight.T                                     # [tokens, 6144]
        if num_tokens <= 64:
            h = torch.zeros(num_tokens, 3 * 128, dtype=torch.float32, device="cuda")
            lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 128, out=h, segments=segments,
                        pdl=True)
        else:
            h = lora_shrink(x, b.pool, slots, b.page_tables, b.ranks, b.a_offsets, 128, partials=True,
                            segments=segments, split_k=split_k, pdl=True)
        lora_expand(out, h, b.pool, slots, b.page_tables, b.ranks, b.b_offsets, b.scalings, out_sizes=out_sizes,
                    segments=segments, pdl=True)
        rotary_qk_(out, cos, sin, 32, 8, 128, pdl=True)        # q/k/v: 32 heads, 8 KV heads of 128
        return out + 0                                         # an ordinary kernel after the LoRA

    step()                                                     # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    for _ in range(2):
        source.copy_(randn((num_tokens, 4096), dtype, gen, "cuda"))
        graph.replay()
        x = (source * 2).float()
        want = x @ weight.float().T
        h_want = reference.lora_shrink(x, b.pool.float(), slots, b.page_tables, b.ranks, b.a_offsets, 128)
        reference.lora_expand(want, h_want, b.pool.float(), slots, b.page_tables, b.ranks, b.b_offsets, b.scalings,
                              out_sizes)
        assert_close(result, want)
