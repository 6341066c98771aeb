"""The FP8 KV cache: reference.quantize_fp8's rounding and saturation, and the kernels' checks of an FP8 pool and
its scales (the kernels' results over one are in test_paged_attention, test_prefill_attention, test_fused_ops)."""
import pytest
import torch
from kernel_helpers import PagedKV as PagedCase
from kernel_helpers import make_generator, make_paged_kv, randn
from torch import Tensor

from slora.kernels import reference
from slora.kernels.checks import check_kv_scales
from slora.kernels.fused_ops import rotary_qk_
from slora.kernels.paged_attention import paged_attention
from slora.kernels.prefill_attention import prefill_attention
from slora.kernels.reference import FP8_MAX, PagedKV, quantize_fp8

FP8 = torch.float8_e4m3fn
SMALLEST_NORMAL = 2.0 ** -6   # E4M3's; below it values are 2**-9 apart


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -5, 0.0137])
def test_quantize_fp8_round_trip_is_within_half_a_step(scale):
    """Dequantized (times the scale), a value is within half an E4M3 step of itself: 2**-4 of it for normal
    values (3 mantissa bits), 2**-10 * scale below the smallest normal."""
    gen = make_generator(1)
    # Magnitudes from about 2**-14 to 2**8 (times the scale): subnormal, normal, near the top.
    x = torch.randn(4096, generator=gen) * 2.0 ** torch.randint(-12, 7, (4096,), generator=gen) * scale
    back = quantize_fp8(x, torch.tensor(scale)).float() * scale
    error = (back - x).abs()
    normal = x.abs() >= SMALLEST_NORMAL * scale
    assert normal.any() and (~normal).any()
    slack = 1 + 1e-6                                  # float32's own rounding of x / scale and back * scale
    assert (error[normal] <= 2.0 ** -4 * x[normal].abs() * slack).all()
    assert (error[~normal] <= 2.0 ** -10 * scale * slack).all()


def test_quantize_fp8_per_head_scales_broadcast():
    """Scales `[heads, 1]` against x `[heads, dims]`: each row quantized by its own scale."""
    x = torch.tensor([[1.0, -3.0], [1.0, -3.0]])
    got = quantize_fp8(x, torch.tensor([[1.0], [0.5]])).float()
    assert torch.equal(got, torch.tensor([[1.0, -3.0], [2.0, -6.0]]))


def test_quantize_fp8_saturates_at_448():
    scale = torch.tensor(0.5)
    x = torch.tensor([224.0, 230.0, 1e4, float("inf"), -1e4, float("-inf")])
    got = quantize_fp8(x, scale).float()
    assert torch.equal(got, torch.tensor([FP8_MAX, FP8_MAX, FP8_MAX, FP8_MAX, -FP8_MAX, -FP8_MAX]))


def test_quantize_fp8_rounds_ties_to_even():
    # 1.0625 lies halfway between 1.0 (even mantissa) and 1.125; 1.1875 between 1.125 and 1.25 (even).
    got = quantize_fp8(torch.tensor([1.0625, 1.1875, -1.0625]), torch.tensor(1.0)).float()
    assert torch.equal(got, torch.tensor([1.0, 1.25, -1.0]))


# --- the kernels' checks -----------------------------------------------------------------------------------

PAGE_SIZE, KV_HEADS, HEAD_DIM = 8, 2, 16


def _fp8_case() -> tuple[Tensor, Tensor, Tensor, PagedCase]:
    """(query [3, 4, 16], an FP8 pool of sequences of 4, 9 and 3 tokens, its scales [2, 2], the paged KV)."""
    gen = make_generator(2)
    kv = make_paged_kv([4, 9, 3], PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.float32, gen)
    scales = torch.full((2, KV_HEADS), 2.0 ** -5)
    pages = reference.kv_page_view(kv.kv_pool, PAGE_SIZE, KV_HEADS)
    pool = quantize_fp8(pages, scales[None, :, None, :, None]).view(kv.kv_pool.shape)
    return randn((3, 4, HEAD_DIM), torch.float32, gen), pool, scales, kv


def _decode(pool: Tensor, kv_scales: Tensor | None) -> None:
    query, _, _, kv = _fp8_case()
    paged_attention(query, pool, kv.block_tables, kv.context_lens, PAGE_SIZE, KV_HEADS, 0.25, kv_scales=kv_scales)


def _prefill(pool: Tensor, kv_scales: Tensor | None, new_kv: bool = False) -> None:
    query, _, _, kv = _fp8_case()
    start_loc = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    keys = (torch.zeros(3, KV_HEADS, HEAD_DIM), torch.zeros(3, KV_HEADS, HEAD_DIM)) if new_kv else None
    prefill_attention(query, pool, kv.block_tables, start_loc, kv.context_lens, PAGE_SIZE, KV_HEADS, 0.25,
                      kv_scales=kv_scales, new_kv=keys)


def _store(pool: Tensor, kv_scales: Tensor | None) -> None:
    gen = make_generator(3)
    qkv = randn((3, (4 + 2 * KV_HEADS) * HEAD_DIM), torch.float32, gen)
    cos, sin = randn((3, HEAD_DIM), torch.float32, gen), randn((3, HEAD_DIM), torch.float32, gen)
    kv = PagedKV(pool, torch.tensor([0, 5, 17], dtype=torch.int32), PAGE_SIZE, kv_scales)
    rotary_qk_(qkv, cos, sin, 4, KV_HEADS, HEAD_DIM, kv=kv)


KERNELS = {"decode": _decode, "prefill": _prefill, "store": _store}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("change,match", [
    (lambda pool, s: (pool, None), "FP8 .* kv_pool needs kv_scales"),
    (lambda pool, s: (pool.float(), s), "kv_scales are for an FP8"),
    (lambda pool, s: (pool, s[:, :1]), r"kv_scales must be float32 \[2, num_kv_heads=2\]"),
    (lambda pool, s: (pool, s.flatten()), r"kv_scales must be float32 \[2, num_kv_heads=2\]"),
    (lambda pool, s: (pool, s.double()), "kv_scales must be float32"),
    (lambda pool, s: (pool, torch.stack([s, s], 2)[:, :, 0]), "kv_scales must be contiguous"),
    (lambda pool, s: (pool, torch.empty(2, 2, device="meta")), "one device"),
    (lambda pool, s: (pool.view(torch.float8_e5m2), None), "must be float8_e4m3fn"),
])
def test_kernels_reject_bad_fp8_scales(kernel, change, match):
    _, pool, scales, _ = _fp8_case()
    pool, kv_scales = change(pool, scales)
    with pytest.raises(ValueError, match=match):
        KERNELS[kernel](pool, kv_scales)


def test_prefill_refuses_new_kv_with_an_fp8_pool():
    _, pool, scales, _ = _fp8_case()
    with pytest.raises(ValueError, match="new_kv cannot go with an FP8 kv_pool"):
        _prefill(pool, scales, new_kv=True)


def test_check_kv_scales_accepts_what_the_kernels_take():
    _, pool, scales, _ = _fp8_case()
    check_kv_scales(pool, scales, KV_HEADS)
    check_kv_scales(pool.float(), None, KV_HEADS)
