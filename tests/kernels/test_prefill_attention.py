"""prefill_attention (Triton) against the torch reference."""
import pytest
import torch
from kernel_helpers import assert_close, fp8_cache, make_generator, make_paged_kv, randn, take_new_kv

from slora.kernels import reference
from slora.kernels.prefill_attention import PrefillLaunch, prefill_attention


def _cases(page_size: int) -> list[tuple[int, int]]:
    # (cached prefix, new tokens): plain prompt, a prompt ending exactly on and one past a page boundary,
    # a one-token chunk after a prefix, a chunk starting mid-page and crossing pages, a long-prefix chunk.
    return [(0, 5), (0, page_size), (0, page_size + 1), (page_size, 1), (3, 2 * page_size - 1),
            (2 * page_size + 1, 20)]


def _run(cases, page_size, num_heads, num_kv_heads, head_dim, dtype, seed, device="cpu", out=None, launch=None,
         new_kv=False, scales=None, halves=False):
    """(kernel, reference) over random sequences of (cached prefix, new tokens); new_kv: the kernel reads the
    new tokens' K/V from tensors of their own, their pool copies NaN. scales, halves: the cache's FP8 scales
    and layout (fp8_cache)."""
    gen = make_generator(seed)
    lengths = [prefix + new for prefix, new in cases]
    kv = make_paged_kv(lengths, page_size, num_kv_heads, head_dim, dtype, gen, device)
    new = torch.tensor([n for _, n in cases])
    start_loc = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).to(torch.int32).to(device)
    query = randn((int(new.sum()), num_heads, head_dim), dtype, gen, device)
    scale = head_dim ** -0.5
    kv_pool, kv_scales = fp8_cache(kv.kv_pool, page_size, num_kv_heads, scales, halves, gen)
    want = reference.prefill_attention(query, kv_pool, kv.block_tables, start_loc, kv.context_lens,
                                       page_size, num_kv_heads, scale, kv_scales)
    taken = take_new_kv(kv_pool, kv.block_tables, cases, page_size, num_kv_heads) if new_kv else None
    got = prefill_attention(query, kv_pool, kv.block_tables, start_loc, kv.context_lens, page_size,
                            num_kv_heads, scale, kv_scales=kv_scales, out=out, launch=launch, new_kv=taken)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_attention_matches_reference(dtype, page_size, num_heads, num_kv_heads, new_kv):
    got, want = _run(_cases(page_size), page_size, num_heads, num_kv_heads, 32, dtype, seed=page_size,
                     new_kv=new_kv)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scales", ["pow2", "any"])
def test_prefill_attention_fp8_cache_matches_reference(dtype, scales):
    # 4 heads over 2 KV heads of different scales; cached prefixes and new tokens over several pages.
    got, want = _run(_cases(8), 8, 4, 2, 32, dtype, seed=20, scales=scales)
    assert_close(got, want)


@pytest.mark.parametrize("dtype,scales,new_kv", [(torch.float16, None, False), (torch.float16, None, True),
                                                 (torch.float32, "any", False)])
def test_prefill_attention_reads_k_and_v_halves(dtype, scales, new_kv):
    got, want = _run(_cases(8), 8, 4, 2, 32, dtype, seed=21, scales=scales, halves=True, new_kv=new_kv)
    assert_close(got, want)


def test_prefill_attention_new_kv_as_views_of_a_fused_projection():
    """Keys and values as column slices of one `[tokens, q + k + v]` tensor (the model's fused q/k/v
    output): row strides wider than the heads."""
    cases = [(0, 21), (13, 6), (4, 1)]
    gen = make_generator(9)
    kv = make_paged_kv([p + n for p, n in cases], 8, 2, 16, torch.float32, gen)
    start_loc = torch.tensor([0, 21, 27, 28], dtype=torch.int32)
    query = randn((28, 4, 16), torch.float32, gen)
    want = reference.prefill_attention(query, kv.kv_pool, kv.block_tables, start_loc, kv.context_lens, 8, 2, 0.25)
    key, value = take_new_kv(kv.kv_pool, kv.block_tables, cases, 8, 2)
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)       # [28, (4 + 2 + 2) * 16]
    key_view, value_view = (fused[:, 64 + i * 32:96 + i * 32].view(28, 2, 16) for i in range(2))
    got = prefill_attention(query, kv.kv_pool, kv.block_tables, start_loc, kv.context_lens, 8, 2, 0.25,
                            new_kv=(key_view, value_view))
    assert_close(got, want)


def test_prefill_attention_gqa_8_and_out_argument():
    out = torch.full((5 + 17 + 1, 8, 16), float("nan"))
    got, want = _run([(0, 5), (9, 17), (40, 1)], 16, 8, 1, 16, torch.float32, seed=3, out=out)
    assert got is out
    assert_close(got, want)


def test_prefill_attention_single_long_sequence():
    got, want = _run([(10, 70)], 8, 2, 1, 16, torch.float16, seed=4)
    assert_close(got, want)


@pytest.mark.parametrize("launch", [PrefillLaunch(32, 16, 2, 1), PrefillLaunch(16, 32, 4, 3)])
def test_prefill_attention_other_launches_match_reference(launch):
    got, want = _run(_cases(8), 8, 4, 2, 16, torch.float32, seed=6, launch=launch)
    assert_close(got, want)


def test_prefill_attention_leaves_rows_outside_the_sequences_alone():
    """Sequences given from the second on (their query_start_loc starting past row 0): the rows before
    them keep what `out` held, the others match the reference of those sequences."""
    cases = [(7, 1), (3, 1), (0, 12), (5, 9)]
    gen = make_generator(7)
    kv = make_paged_kv([p + n for p, n in cases], 8, 1, 16, torch.float32, gen)
    start_loc = torch.tensor([0, 1, 2, 14, 23], dtype=torch.int32)
    query = randn((23, 2, 16), torch.float32, gen)
    out = torch.full_like(query, float("nan"))
    prefill_attention(query, kv.kv_pool, kv.block_tables[2:], start_loc[2:], kv.context_lens[2:], 8, 1, 0.25,
                      out=out)
    want = reference.prefill_attention(query, kv.kv_pool, kv.block_tables, start_loc, kv.context_lens, 8, 1, 0.25)
    assert out[:2].isnan().all()
    assert_close(out[2:], want[2:])


@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_attention_leaves_whole_blocks_before_the_first_sequence_alone(new_kv):
    """query_start_loc[0] = 37, past two whole row blocks of 16 (the interpreter's launch): those blocks
    belong to no sequence, and write nothing."""
    cases = [(0, 5), (4, 11)]
    gen = make_generator(12)
    kv = make_paged_kv([p + n for p, n in cases], 8, 1, 16, torch.float32, gen)
    start_loc = torch.tensor([37, 42, 53], dtype=torch.int32)
    query = randn((53, 2, 16), torch.float32, gen)
    want = reference.prefill_attention(query[37:], kv.kv_pool, kv.block_tables, start_loc - 37, kv.context_lens,
                                       8, 1, 0.25)
    taken = take_new_kv(kv.kv_pool, kv.block_tables, cases, 8, 1) if new_kv else None
    rows = None if taken is None else tuple(torch.cat([torch.zeros(37, *t.shape[1:]), t]) for t in taken)
    out = torch.full_like(query, float("nan"))
    prefill_attention(query, kv.kv_pool, kv.block_tables, start_loc, kv.context_lens, 8, 1, 0.25, out=out,
                      new_kv=rows)
    assert out[:37].isnan().all()
    assert_close(out[37:], want)


@pytest.mark.parametrize("launch", [None, PrefillLaunch(16, 32, 4, 2)])
def test_prefill_attention_new_kv_ignores_rows_past_the_sequences(launch):
    """The step's q/k/v buffers longer than its sequences (a bucket of a CUDA graph), the rows past them NaN:
    the last sequence's diagonal block reads some of those rows, and none of them may reach the output."""
    cases = [(0, 19), (5, 11)]
    gen = make_generator(10)
    kv = make_paged_kv([p + n for p, n in cases], 8, 2, 16, torch.float32, gen)
    start_loc = torch.tensor([0, 19, 30], dtype=torch.int32)
    query = randn((30, 4, 16), torch.float32, gen)
    want = reference.prefill_attention(query, kv.kv_pool, kv.block_tables, start_loc, kv.context_lens, 8, 2, 0.25)
    key, value = take_new_kv(kv.kv_pool, kv.block_tables, cases, 8, 2)
    padded = [torch.cat([t, torch.full((34, *t.shape[1:]), float("nan"))]) for t in (query, key, value)]
    out = torch.full_like(padded[0], float("nan"))
    prefill_attention(padded[0], kv.kv_pool, kv.block_tables, start_loc, kv.context_lens, 8, 2, 0.25, out=out,
                      launch=launch, new_kv=(padded[1], padded[2]))
    assert_close(out[:30], want)
    assert out[30:].isnan().all()


@pytest.mark.parametrize("launch,match", [(PrefillLaunch(48, 16, 4, 2), "block_m must be a power of two"),
                                          (PrefillLaunch(16, 8, 4, 2), "blocks must be >= 16"),
                                          (PrefillLaunch(16, 16, 0, 2), "num_warps must be"),
                                          (PrefillLaunch(16, 16, 4, 0), "num_stages must be >= 1")])
def test_prefill_attention_rejects_bad_launches(launch, match):
    gen = make_generator(8)
    kv = make_paged_kv([4], 8, 1, 16, torch.float32, gen)
    with pytest.raises(ValueError, match=match):
        prefill_attention(randn((4, 1, 16), torch.float32, gen), kv.kv_pool, kv.block_tables,
                          torch.tensor([0, 4], dtype=torch.int32), kv.context_lens, 8, 1, 0.25, launch=launch)


def _bad_args(q, kv, start_loc, **changes):
    args = {"query": q, "kv_pool": kv.kv_pool, "block_tables": kv.block_tables, "query_start_loc": start_loc,
                "context_lens": kv.context_lens, "page_size": 8, "num_kv_heads": 1, "scale": 0.1}
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,match", [
    (lambda q, kv, sl: {"query": q[0]}, "query must be"),
    (lambda q, kv, sl: {"query_start_loc": sl[:-1]}, "query_start_loc must be"),
    (lambda q, kv, sl: {"block_tables": kv.block_tables[:1]}, "block_tables must be"),
    (lambda q, kv, sl: {"num_kv_heads": 3}, "multiple of num_kv_heads"),
    (lambda q, kv, sl: {"page_size": 4}, "page_elems"),
    (lambda q, kv, sl: {"query": q.to(torch.int32)}, "float16, bfloat16 or float32"),
    (lambda q, kv, sl: {"context_lens": kv.context_lens.float()}, "int32 or int64"),
    (lambda q, kv, sl: {"new_kv": (q[:, :1], q[:, :1, :8])}, "value must be"),
    (lambda q, kv, sl: {"new_kv": (q[:, :1].half(), q[:, :1])}, "key must have kv_pool's dtype"),
    (lambda q, kv, sl: {"new_kv": (q.flatten(1)[:, 1:17].view(6, 1, 16), q[:, :1])}, "key must start 16-byte"),
    (lambda q, kv, sl: {"new_kv": (q[:, :1], q[:, :1]),
                        "query": torch.cat([q.flatten(1), q[:, 0, :1]], 1)[:, :32].view(6, 2, 16)},
     "query must start 16-byte aligned and have token and head strides"),
])
def test_prefill_attention_rejects_bad_input(changes, match):
    gen = make_generator(5)
    kv = make_paged_kv([4, 9], 8, 1, 16, torch.float32, gen)
    start_loc = torch.tensor([0, 4, 6], dtype=torch.int32)
    query = randn((6, 2, 16), torch.float32, gen)
    with pytest.raises(ValueError, match=match):
        prefill_attention(**_bad_args(query, kv, start_loc, **changes(query, kv, start_loc)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_attention_gpu(dtype, page_size, new_kv):
    cases = [(0, 1), (0, page_size), (page_size, page_size + 1), (0, 2048), (1000, 777), (3000, 1096), (17, 300)]
    got, want = _run(cases, page_size, 32, 8, 128, dtype, seed=page_size, device="cuda", new_kv=new_kv)
    assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales,halves,new_kv", [("pow2", False, False), ("any", False, False),
                                                  (None, True, False), (None, True, True), ("pow2", True, False)])
def test_prefill_attention_gpu_fp8_and_halves(dtype, scales, halves, new_kv):
    if scales and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 (e4m3) conversions need compute capability 8.9")
    cases = [(0, 1), (0, 16), (16, 17), (0, 2048), (1000, 777), (3000, 1096), (17, 300)]
    got, want = _run(cases, 16, 32, 8, 128, dtype, seed=22, device="cuda", new_kv=new_kv, scales=scales,
                     halves=halves)
    assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 32, 128), (16, 2, 64)])
def test_prefill_attention_gpu_shapes(num_heads, num_kv_heads, head_dim):
    got, want = _run([(0, 100), (64, 64), (5, 1)], 16, num_heads, num_kv_heads, head_dim, torch.bfloat16,
                     seed=head_dim, device="cuda")
    assert_close(got, want)


def _compiled_variants(kernel) -> int:
    """How many variants a Triton kernel has compiled (its device caches' kernel caches, Triton 3.x)."""
    caches = [entry[0] if isinstance(entry, tuple) else entry for entry in kernel.device_caches.values()]
    return sum(len(cache) for cache in caches)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_attention_new_kv_compiles_one_variant_for_any_token_count():
    """The engine compiles the new_kv kernel in its warm-up, at one token count. A step of another count (odd,
    or of another divisibility by 16) or of more sequences must launch that same variant: a new one would
    compile in the middle of serving (seconds). The count reaches the kernel in its tensor descriptors'
    shapes, so this holds only if Triton does not specialise those."""
    from slora.kernels.prefill_attention import _prefill_new_kv_kernel

    counts = []
    for seed, cases in enumerate([[(0, 2048)], [(0, 2049)], [(0, 1000), (0, 1056)], [(0, 7), (0, 2050), (0, 3)]]):
        got, want = _run(cases, 16, 32, 8, 128, torch.bfloat16, seed=seed, device="cuda", new_kv=True)
        assert_close(got, want)
        counts.append(_compiled_variants(_prefill_new_kv_kernel))
    assert counts[0] >= 1 and counts == [counts[0]] * len(counts), counts
