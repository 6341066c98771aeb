"""paged_attention (Triton decode) against the torch reference."""
import pytest
import torch
from kernel_helpers import assert_close, fp8_cache, make_generator, make_paged_kv, randn

from slora.kernels import reference
from slora.kernels.paged_attention import DecodeLaunch, choose_num_splits, paged_attention


def _lengths(page_size: int) -> list[int]:
    # Ragged: one token, exactly one page, one past a page, one short of two pages, and a longer one.
    return [1, page_size, page_size + 1, 2 * page_size - 1, 3 * page_size + 5]


def _run(lengths, page_size, num_heads, num_kv_heads, head_dim, dtype, seed, device="cpu", scales=None,
         halves=False, **kwargs):
    """(kernel, reference); scales, halves: the cache's FP8 scales and layout (fp8_cache)."""
    gen = make_generator(seed)
    kv = make_paged_kv(lengths, page_size, num_kv_heads, head_dim, dtype, gen, device)
    # The query as a head slice of a wider fused qkv row, as the engine passes it.
    qkv = randn((len(lengths), num_heads + 2, head_dim), dtype, gen, device)
    query = qkv[:, :num_heads]
    scale = head_dim ** -0.5
    kv_pool, kv_scales = fp8_cache(kv.kv_pool, page_size, num_kv_heads, scales, halves, gen)
    got = paged_attention(query, kv_pool, kv.block_tables, kv.context_lens, page_size, num_kv_heads, scale,
                          kv_scales=kv_scales, **kwargs)
    want = reference.paged_attention(query, kv_pool, kv.block_tables, kv.context_lens, page_size,
                                     num_kv_heads, scale, kv_scales)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_matches_reference(dtype, page_size, num_heads, num_kv_heads, num_splits):
    got, want = _run(_lengths(page_size), page_size, num_heads, num_kv_heads, 32, dtype,
                     seed=page_size + num_heads, num_splits=num_splits)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scales", ["pow2", "any"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_fp8_cache_matches_reference(dtype, scales, num_splits):
    # 4 heads over 2 KV heads of different scales; contexts of up to 4 pages, split 3 ways too.
    got, want = _run(_lengths(8), 8, 4, 2, 32, dtype, seed=20 + num_splits, scales=scales, num_splits=num_splits)
    assert_close(got, want)


@pytest.mark.parametrize("dtype,scales,num_splits", [(torch.float16, None, 3), (torch.float32, "pow2", 1)])
def test_paged_attention_reads_k_and_v_halves(dtype, scales, num_splits):
    got, want = _run(_lengths(8), 8, 4, 2, 32, dtype, seed=30, scales=scales, halves=True, num_splits=num_splits)
    assert_close(got, want)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_paged_attention_head_dims_and_default_splits(head_dim):
    got, want = _run([5, 40, 17], 16, 4, 2, head_dim, torch.float32, seed=head_dim)
    assert_close(got, want)


@pytest.mark.parametrize("block_n", [16, 128])
@pytest.mark.parametrize("scales,num_splits", [(None, 1), (None, 3), ("pow2", 1), ("any", 3)])
def test_paged_attention_other_launches_match_reference(block_n, scales, num_splits):
    """Tokens per loop iteration below a page and past every context (the sweep's range), bf16-like half and
    FP8 caches, split and not: each split's share of a context is a multiple of block_n."""
    got, want = _run(_lengths(16), 16, 8, 2, 32, torch.float16, seed=block_n + num_splits, scales=scales,
                     num_splits=num_splits, launch=DecodeLaunch(block_n=block_n, num_stages=2))
    assert_close(got, want)


@pytest.mark.parametrize("options,match", [
    ({"block_n": 48}, "power of two"), ({"block_n": 8}, "power of two"),
    ({"num_warps": 3}, "num_warps"), ({"num_stages": 0}, "num_stages")])
def test_decode_launch_refuses_what_the_kernel_cannot_run(options, match):
    with pytest.raises(ValueError, match=match):
        DecodeLaunch(**options)


def test_paged_attention_more_splits_than_tokens_and_out_argument():
    gen = make_generator(7)
    kv = make_paged_kv([3, 70], 8, 2, 16, torch.float32, gen)
    query = randn((2, 4, 16), torch.float32, gen)
    out = torch.full_like(query, float("nan"))
    result = paged_attention(query, kv.kv_pool, kv.block_tables, kv.context_lens, 8, 2, 0.3,
                             num_splits=8, out=out)
    assert result is out
    assert_close(out, reference.paged_attention(query, kv.kv_pool, kv.block_tables, kv.context_lens, 8, 2, 0.3))


def test_paged_attention_empty_context_gives_zeros():
    # A padding row of a CUDA-graph batch has context length 0: zeros, never NaN.
    gen = make_generator(8)
    kv = make_paged_kv([9, 0], 8, 1, 16, torch.float32, gen)
    query = randn((2, 2, 16), torch.float32, gen)
    for splits in (1, 2):
        out = paged_attention(query, kv.kv_pool, kv.block_tables, kv.context_lens, 8, 1, 0.25, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert_close(out[:1], reference.paged_attention(query[:1], kv.kv_pool, kv.block_tables[:1],
                                                        kv.context_lens[:1], 8, 1, 0.25))


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 4096, multiprocessors=132) == 1      # enough programs already
    assert choose_num_splits(1, 8, 100, multiprocessors=132) == 1         # too short to split
    long_single = choose_num_splits(1, 8, 32768, multiprocessors=132)
    assert 16 <= long_single <= 64                                          # small batch, long context
    assert choose_num_splits(1, 8, 1024, multiprocessors=132) <= 1024 // 256


def _bad(q, kv, **changes):
    args = {"query": q, "kv_pool": kv.kv_pool, "block_tables": kv.block_tables, "context_lens": kv.context_lens,
                "page_size": 8, "num_kv_heads": 2, "scale": 0.1}
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,match", [
    (lambda q, kv: {"query": q[0]}, "query must be"),
    (lambda q, kv: {"num_kv_heads": 3}, "multiple of num_kv_heads"),
    (lambda q, kv: {"page_size": 16}, "page_elems"),
    (lambda q, kv: {"block_tables": kv.block_tables[:1]}, "block_tables must be"),
    (lambda q, kv: {"context_lens": kv.context_lens.float()}, "int32 or int64"),
    (lambda q, kv: {"query": q.transpose(1, 2).contiguous().transpose(1, 2)}, "stride 1"),
    (lambda q, kv: {"query": q[:, :, :12], "kv_pool": kv.kv_pool[:, :2 * 8 * 2 * 12]}, "power of two"),
    (lambda q, kv: {"num_splits": 0}, "num_splits"),
    (lambda q, kv: {"kv_pool": kv.kv_pool.view(-1, 2, 8, 2, 16)[:, :, :4]}, "num_kv_heads, head_dim\\] = "),
    (lambda q, kv: {"kv_pool": kv.kv_pool.view(-1, 2, 2, 8, 16).transpose(2, 3)}, "contiguous in its last three"),
])
def test_paged_attention_rejects_bad_input(changes, match):
    gen = make_generator(9)
    kv = make_paged_kv([5, 9], 8, 2, 16, torch.float32, gen)
    query = randn((2, 4, 16), torch.float32, gen)
    with pytest.raises(ValueError, match=match):
        paged_attention(**_bad(query, kv, **changes(query, kv)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [16, 32, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_paged_attention_gpu(dtype, page_size, num_splits):
    gen = make_generator(page_size)
    lengths = [1, page_size, page_size + 1, 4096, 4095, 1000] + torch.randint(1, 4097, (10,), generator=gen).tolist()
    got, want = _run(lengths, page_size, 32, 8, 128, dtype, seed=page_size, device="cuda", num_splits=num_splits)
    assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales,halves", [("pow2", False), ("any", False), (None, True), ("pow2", True)])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_paged_attention_gpu_fp8_and_halves(dtype, scales, halves, num_splits):
    if scales and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 (e4m3) conversions need compute capability 8.9")
    gen = make_generator(17)
    lengths = [1, 16, 17, 4096, 4095, 1000] + torch.randint(1, 4097, (10,), generator=gen).tolist()
    got, want = _run(lengths, 16, 32, 8, 128, dtype, seed=18, device="cuda", scales=scales, halves=halves,
                     num_splits=num_splits)
    assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 32, 128), (32, 4, 64), (16, 2, 256)])
def test_paged_attention_gpu_shapes(num_heads, num_kv_heads, head_dim):
    got, want = _run([1, 17, 300, 2048], 16, num_heads, num_kv_heads, head_dim, torch.bfloat16, seed=head_dim,
                     device="cuda")
    assert_close(got, want)
