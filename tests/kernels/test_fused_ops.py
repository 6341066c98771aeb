"""rms_norm / rotary_qk_ (with and without storing K/V) / silu_and_mul (Triton) against the torch reference.

The kernels round to the input dtype wherever the reference's torch ops do, so half-precision results
are compared in units in the last place (ulps): rotary and the sum x + delta must be exact, the norm
and SiLU may differ by rounding-boundary cases of their float32 reductions / exp. bfloat16 runs only on
the GPU: the Triton interpreter truncates float32 -> bfloat16 casts instead of rounding them.
"""
import pytest
import torch
from kernel_helpers import has_pdl, make_generator, randn
from torch import Tensor

from slora.kernels import fused_ops, reference
from slora.kernels.fused_ops import rms_norm, rotary_qk_, silu_and_mul
from slora.kernels.reference import PagedKV

CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.bfloat16, torch.float16]
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}
EPS = 1e-6


def _ulp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Spacing of `dtype` numbers at |x| (float64); subnormals share the smallest normal's spacing."""
    tiny = torch.finfo(dtype).tiny
    _, exponent = torch.frexp(x.double().abs().clamp(min=tiny))       # |x| = m * 2**exponent, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 1 - MANTISSA_BITS[dtype])


def _assert_matches(actual: Tensor, expected: Tensor, max_ulps: int, max_mismatch: float = 0.01) -> None:
    """float32: tight tolerance. float16/bfloat16: no element more than `max_ulps` ulps away, and at most
    a `max_mismatch` fraction (at least one element) not equal: with the reference's rounding steps
    mimicked only rounding-boundary cases differ (about 1 in 40000 on the CPU), while a kernel that
    skips one of those steps differs in 10-30% of the elements."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not torch.isnan(actual).any(), "kernel output holds NaN"
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        return
    ulps = (actual.double() - expected.double()).abs() / _ulp(expected, actual.dtype)
    assert ulps.max().item() <= max_ulps, f"{int((ulps > max_ulps).sum())} elements differ by more than " \
                                          f"{max_ulps} ulps (worst {ulps.max().item()})"
    mismatches = int((actual != expected).sum())
    assert mismatches <= max(1, int(max_mismatch * actual.numel())), \
        f"{mismatches} of {actual.numel()} elements differ from the reference"


def _columns(tokens: int, width: int, dtype: torch.dtype, gen: torch.Generator, device: str, strided: bool,
             extra: int = 8) -> tuple[Tensor, Tensor]:
    """(wide, x): x `[tokens, width]` is `wide` itself, or a column slice of a wider `wide` (strided rows,
    like the engine's fused projection outputs)."""
    if not strided:
        wide = randn((tokens, width), dtype, gen, device)
        return wide, wide
    wide = randn((tokens, width + extra), dtype, gen, device)
    return wide, wide[:, 3:3 + width]


# --- rms_norm -------------------------------------------------------------------------------------

def _rms_case(tokens: int, hidden: int, dtype: torch.dtype, strided: bool, seed: int,
              device: str = "cpu") -> tuple[Tensor, Tensor]:
    gen = make_generator(seed)
    _, x = _columns(tokens, hidden, dtype, gen, device, strided)
    weight = randn((hidden,), dtype, gen, device)
    return x, weight


def _check_rms(x: Tensor, weight: Tensor, max_mismatch: float = 0.01) -> None:
    x_before = x.clone()
    out, summed = rms_norm(x, weight, EPS)
    expected_out, _ = reference.rms_norm(x, weight, EPS)
    assert torch.equal(x, x_before), "x was modified"
    assert out.is_contiguous()
    assert summed is x
    # The float32 sum of squares and rsqrt differ from torch's in the last float32 bits, so a normalised
    # value near a rounding boundary may round the other way (1 ulp), which weight * normed can double.
    _assert_matches(out, expected_out, max_ulps=2, max_mismatch=max_mismatch)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 128])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rms_norm_matches_reference(dtype, hidden, tokens):
    x, weight = _rms_case(tokens, hidden, dtype, strided=False, seed=hidden + tokens)
    _check_rms(x, weight)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rms_norm_strided_rows(dtype):
    x, weight = _rms_case(7, 96, dtype, strided=True, seed=4)
    assert not x.is_contiguous()
    _check_rms(x, weight)


def test_rms_norm_no_tokens():
    x, weight = _rms_case(0, 64, torch.float16, strided=False, seed=5)
    out, summed = rms_norm(x, weight, EPS)
    assert out.shape == (0, 64) and summed.shape == (0, 64)
    assert out.dtype == summed.dtype == torch.float16


def _meta(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize("change,match", [
    (lambda x, w, eps: (x[0], w, eps), "x must be"),
    (lambda x, w, eps: (x, w[:-1], eps), "weight must be"),
    (lambda x, w, eps: (x, w.half(), eps), "weight dtype"),
    (lambda x, w, eps: (x.double(), w.double(), eps), "float16, bfloat16 or float32"),
    (lambda x, w, eps: (x.T.contiguous().T, w, eps), "x must be contiguous in its last dim"),
    (lambda x, w, eps: (x, w, -1e-6), "eps must be"),
    (lambda x, w, eps: (x, _meta(w), eps), "one device"),
    (lambda x, w, eps: (x[:, :0], w[:0], eps), "hidden must be"),
    (lambda x, w, eps: (x.new_ones(2, fused_ops.MAX_HIDDEN + 1), w.new_ones(fused_ops.MAX_HIDDEN + 1), eps),
     "hidden must be"),
])
def test_rms_norm_rejects_bad_input(change, match):
    x, weight = _rms_case(4, 32, torch.float32, strided=False, seed=6)
    x, weight, eps = change(x, weight, EPS)
    with pytest.raises(ValueError, match=match):
        rms_norm(x, weight, eps)


# --- rotary_qk_ -----------------------------------------------------------------------------------

def _rotary_case(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int,
                 device: str = "cpu") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(wide, qkv, cos, sin): qkv a column slice of `wide`. cos/sin are random, with different halves,
    so a kernel that mixes up the halves of the table fails."""
    gen = make_generator(seed)
    wide, qkv = _columns(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype, gen, device, strided=True)
    cos = randn((tokens, head_dim), dtype, gen, device)
    sin = randn((tokens, head_dim), dtype, gen, device)
    return wide, qkv, cos, sin


def _check_rotary(wide: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor, heads: tuple[int, int, int]) -> None:
    expected = wide.clone()
    start = qkv.storage_offset() - wide.storage_offset()
    reference.rotary_qk_(expected[:, start:start + qkv.shape[1]], cos, sin, *heads)
    rotary_qk_(qkv, cos, sin, *heads)
    # The whole wide tensor: v columns and the columns around the slice must be untouched.
    assert torch.equal(wide, expected)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("heads", [(4, 1, 16), (2, 2, 32), (4, 1, 32)])
def test_rotary_qk_matches_reference(dtype, tokens, heads):
    wide, qkv, cos, sin = _rotary_case(tokens, *heads, dtype, seed=tokens + heads[2])
    _check_rotary(wide, qkv, cos, sin, heads)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rotary_qk_several_head_blocks(dtype, monkeypatch):
    # Two heads per program: 5 q/k heads give 3 programs per token, the last one half masked.
    monkeypatch.setattr(fused_ops, "ROTARY_BLOCK_ELEMS", 32)
    wide, qkv, cos, sin = _rotary_case(7, 4, 1, 16, dtype, seed=7)
    _check_rotary(wide, qkv, cos, sin, (4, 1, 16))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("heads", [(4, 0, 16), (0, 2, 32), (0, 1, 16)])
def test_rotary_qk_of_q_alone_or_k_and_v_alone(dtype, heads):
    """The last layer projects q for its sampled rows and k/v for every row apart: num_kv_heads 0 rotates q
    heads alone, num_heads 0 the k heads of k/v columns alone (v untouched), with a delta too."""
    wide, qkv, cos, sin = _rotary_case(7, *heads, dtype, seed=50 + heads[0])
    _check_rotary(wide, qkv, cos, sin, heads)
    wide, qkv, cos, sin = _rotary_case(9, *heads, dtype, seed=60 + heads[0])
    _check_rotary_with_delta(wide, qkv, cos, sin, heads, seed=61)


def test_rotary_qk_of_q_alone_moves_every_column():
    """A q-only qkv has no v columns: all of them rotate (a kernel that took the last heads for v would
    leave them as they were)."""
    _, qkv, cos, sin = _rotary_case(3, 4, 0, 16, torch.float32, seed=70)
    before = qkv.clone()
    rotary_qk_(qkv, cos, sin, 4, 0, 16)
    assert not torch.isclose(qkv, before).view(3, 4, 16).all(dim=2).any()


def test_rotary_qk_no_tokens():
    _, qkv, cos, sin = _rotary_case(0, 4, 1, 16, torch.float16, seed=8)
    rotary_qk_(qkv, cos, sin, 4, 1, 16)
    assert qkv.shape == (0, 96)


@pytest.mark.parametrize("change,match", [
    (lambda q, c, s, h: (q[0], c, s, h), "qkv must be"),
    (lambda q, c, s, h: (q[:, :-16], c, s, h), "columns"),
    (lambda q, c, s, h: (q, c, s, (3, 2, 16)), "multiple of num_kv_heads"),
    (lambda q, c, s, h: (q[:, :0], c, s, (0, 0, 16)), "not both"),
    (lambda q, c, s, h: (q, c, s, (-2, 3, 16)), "multiple of num_kv_heads"),
    (lambda q, c, s, h: (q[:, :72], c[:, :12], s[:, :12], (4, 1, 12)), "power of two"),
    (lambda q, c, s, h: (q[:, :48], c[:, :8], s[:, :8], (4, 1, 8)), "power of two"),
    (lambda q, c, s, h: (q, c[:, :8], s, h), "cos must be"),
    (lambda q, c, s, h: (q, c, s[:-1], h), "sin must be"),
    (lambda q, c, s, h: (q, c, s.half(), h), "sin dtype"),
    (lambda q, c, s, h: (q.double(), c.double(), s.double(), h), "float16, bfloat16 or float32"),
    (lambda q, c, s, h: (q.T.contiguous().T, c, s, h), "qkv must be contiguous in its last dim"),
    (lambda q, c, s, h: (q, c.T.contiguous().T, s, h), "cos must be contiguous"),
    (lambda q, c, s, h: (q, _meta(c), s, h), "one device"),
])
def test_rotary_qk_rejects_bad_input(change, match):
    _, qkv, cos, sin = _rotary_case(4, 4, 1, 16, torch.float32, seed=9)
    qkv, cos, sin, heads = change(qkv, cos, sin, (4, 1, 16))
    with pytest.raises(ValueError, match=match):
        rotary_qk_(qkv, cos, sin, *heads)


# --- silu_and_mul ---------------------------------------------------------------------------------

def _check_silu(gate_up: Tensor, max_mismatch: float = 0.01) -> None:
    before = gate_up.clone()
    out = silu_and_mul(gate_up)
    assert torch.equal(gate_up, before), "gate_up was modified"
    assert out.is_contiguous()
    # exp differs from torch's in the last float32 bits, so SiLU near a rounding boundary may round the
    # other way (1 ulp), which silu * up can double.
    _assert_matches(out, reference.silu_and_mul(gate_up), max_ulps=2, max_mismatch=max_mismatch)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("inter", [8, 48, 96])
@pytest.mark.parametrize("strided", [False, True])
def test_silu_and_mul_matches_reference(dtype, tokens, inter, strided):
    _, gate_up = _columns(tokens, 2 * inter, dtype, make_generator(inter + tokens), "cpu", strided)
    _check_silu(gate_up)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_silu_and_mul_several_column_blocks(dtype, monkeypatch):
    # 16 columns per program: 40 columns give 3 programs per token, the last one half masked.
    monkeypatch.setattr(fused_ops, "SILU_BLOCK", 16)
    _, gate_up = _columns(7, 80, dtype, make_generator(10), "cpu", strided=True)
    _check_silu(gate_up)


def test_silu_and_mul_no_tokens():
    out = silu_and_mul(torch.empty(0, 64, dtype=torch.float16))
    assert out.shape == (0, 32) and out.dtype == torch.float16


@pytest.mark.parametrize("change,match", [
    (lambda g: g[0], "gate_up must be"),
    (lambda g: g[:, :-1], "positive even number of columns"),
    (lambda g: g[:, :0], "positive even number of columns"),
    (lambda g: g.double(), "float16, bfloat16 or float32"),
    (lambda g: g.T.contiguous().T, "stride 1"),
])
def test_silu_and_mul_rejects_bad_input(change, match):
    _, gate_up = _columns(4, 32, torch.float32, make_generator(11), "cpu", strided=False)
    with pytest.raises(ValueError, match=match):
        silu_and_mul(change(gate_up))


# --- GPU, real sizes (Llama-8B: hidden 4096, 32 q / 8 kv heads of 128, intermediate 14336) ------------

@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_gpu(dtype, strided):
    x, weight = _rms_case(64, 4096, dtype, strided, seed=12, device="cuda")
    # rsqrt.approx and the reduction order differ more from torch's CUDA kernel than the interpreter
    # from torch's CPU one: a wider mismatch allowance, still far below a missing rounding step's.
    _check_rms(x, weight, max_mismatch=0.02)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rotary_qk_gpu(dtype):
    wide, qkv, cos, sin = _rotary_case(64, 32, 8, 128, dtype, seed=13, device="cuda")
    _check_rotary(wide, qkv, cos, sin, (32, 8, 128))


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_silu_and_mul_gpu(dtype, strided):
    _, gate_up = _columns(64, 2 * 14336, dtype, make_generator(14), "cuda", strided)
    # Triton's exp (ex2.approx) differs from torch's expf by a few float32 ulps: a wider mismatch
    # allowance, still far below a missing rounding step's.
    _check_silu(gate_up, max_mismatch=0.02)


# --- a LoRA delta added first (lora_expand(add=False) wrote it; the rows of tokens with an adapter) -----

def _delta_case(like: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(delta, token_slots) for `like` `[tokens, width]`: about a third of the tokens without adapter, whose
    delta rows are NaN (never written in the engine), so a kernel that adds them fails. The delta is a
    column slice of a wider tensor, so a kernel that ignores its row stride fails too."""
    tokens, width = like.shape
    slots = torch.randint(0, 3, (tokens,), generator=gen).to(torch.int32)
    slots[torch.rand(tokens, generator=gen) < 0.35] = -1
    slots[0] = -1
    delta = randn((tokens, width + 5), like.dtype, gen, "cpu")[:, 2:2 + width]
    delta[slots < 0] = float("nan")
    return delta.to(like.device), slots.to(like.device)


def _with_delta(x: Tensor, delta: Tensor, slots: Tensor) -> Tensor:
    """x with delta added in the rows of tokens with an adapter: one rounding of the sum, as torch adds."""
    added = x.clone()
    rows = slots >= 0
    added[rows] = x[rows] + delta[rows]
    return added


def _check_rms_with_delta(x: Tensor, weight: Tensor, seed: int, max_mismatch: float = 0.01,
                          pdl: bool = False) -> None:
    delta, slots = _delta_case(x, make_generator(seed))
    out, summed = rms_norm(x, weight, EPS, delta=delta, token_slots=slots, pdl=pdl)
    expected_out, expected_sum = reference.rms_norm(_with_delta(x, delta, slots), weight, EPS)
    assert summed is not x and summed.is_contiguous() and torch.equal(summed, expected_sum)
    _assert_matches(out, expected_out, max_ulps=2, max_mismatch=max_mismatch)
    # The reference's own delta argument gives the same.
    reference_out, reference_sum = reference.rms_norm(x, weight, EPS, delta, slots)
    assert torch.equal(reference_out, expected_out) and torch.equal(reference_sum, expected_sum)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rms_norm_adds_the_lora_delta(dtype):
    x, weight = _rms_case(9, 96, dtype, strided=True, seed=20)
    _check_rms_with_delta(x, weight, seed=21)


def _check_rotary_with_delta(wide: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor, heads: tuple[int, int, int],
                             seed: int, pdl: bool = False) -> None:
    delta, slots = _delta_case(qkv, make_generator(seed))
    expected = wide.clone()
    start = qkv.storage_offset() - wide.storage_offset()
    columns = expected[:, start:start + qkv.shape[1]]
    by_reference = columns.clone()
    columns.copy_(_with_delta(columns, delta, slots))
    reference.rotary_qk_(columns, cos, sin, *heads)
    reference.rotary_qk_(by_reference, cos, sin, *heads, delta, slots)   # the reference's own delta argument
    assert torch.equal(by_reference, columns)
    rotary_qk_(qkv, cos, sin, *heads, delta=delta, token_slots=slots, pdl=pdl)
    # The v columns too hold the delta now; the columns around the slice are untouched.
    assert torch.equal(wide, expected)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("heads", [(4, 1, 16), (2, 2, 32)])
def test_rotary_qk_adds_the_lora_delta(dtype, heads):
    wide, qkv, cos, sin = _rotary_case(9, *heads, dtype, seed=22)
    _check_rotary_with_delta(wide, qkv, cos, sin, heads, seed=23)


def _check_silu_with_delta(gate_up: Tensor, seed: int, max_mismatch: float = 0.01, pdl: bool = False) -> None:
    delta, slots = _delta_case(gate_up, make_generator(seed))
    out = silu_and_mul(gate_up, delta=delta, token_slots=slots, pdl=pdl)
    expected = reference.silu_and_mul(_with_delta(gate_up, delta, slots))
    _assert_matches(out, expected, max_ulps=2, max_mismatch=max_mismatch)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_silu_and_mul_adds_the_lora_delta(dtype):
    _, gate_up = _columns(9, 96, dtype, make_generator(24), "cpu", strided=True)
    _check_silu_with_delta(gate_up, seed=25)


def test_reference_ops_add_the_lora_delta_only_where_there_is_an_adapter():
    gen = make_generator(26)
    _, gate_up = _columns(9, 32, torch.float32, gen, "cpu", strided=False)
    delta, slots = _delta_case(gate_up, gen)
    got = reference.silu_and_mul(gate_up, delta, slots)
    rows = slots >= 0
    assert torch.equal(got[~rows], reference.silu_and_mul(gate_up)[~rows])
    assert not torch.allclose(got[rows], reference.silu_and_mul(gate_up)[rows])


@pytest.mark.parametrize("op", ["norm", "rotary", "silu"])
@pytest.mark.parametrize("change,match", [
    (lambda d, s: (d, None), "give both or neither"),
    (lambda d, s: (d[:, :-2], s), "delta shape"),
    (lambda d, s: (d, s.long()), "token_slots must be int32"),
    (lambda d, s: (d, s[:-1]), "token_slots must be int32"),
    (lambda d, s: (d.half(), s), "dtype"),
    (lambda d, s: (d, torch.stack([s, s], 1)[:, 0]), "token_slots must be contiguous"),
])
def test_ops_reject_a_bad_delta(op, change, match):
    gen = make_generator(27)
    wide, qkv, cos, sin = _rotary_case(4, 4, 1, 16, torch.float32, seed=28)
    delta, slots = change(*_delta_case(qkv, gen))
    calls = {"norm": lambda: rms_norm(qkv, torch.ones(qkv.shape[1]), EPS, delta=delta, token_slots=slots),
             "rotary": lambda: rotary_qk_(qkv, cos, sin, 4, 1, 16, delta=delta, token_slots=slots),
             "silu": lambda: silu_and_mul(qkv, delta=delta, token_slots=slots)}
    with pytest.raises(ValueError, match=match):
        calls[op]()


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ops_add_the_lora_delta_gpu(dtype, pdl):
    if pdl and not has_pdl():
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    x, weight = _rms_case(64, 4096, dtype, strided=True, seed=29, device="cuda")
    _check_rms_with_delta(x, weight, seed=30, max_mismatch=0.02, pdl=pdl)
    wide, qkv, cos, sin = _rotary_case(64, 32, 8, 128, dtype, seed=31, device="cuda")
    _check_rotary_with_delta(wide, qkv, cos, sin, (32, 8, 128), seed=32, pdl=pdl)
    _, gate_up = _columns(64, 2 * 14336, dtype, make_generator(33), "cuda", strided=True)
    _check_silu_with_delta(gate_up, seed=34, max_mismatch=0.02, pdl=pdl)


# --- rotary_qk_ storing the new K/V into the pool (kv=PagedKV) --------------------------------------------

def _kv_scales(scales: str | None, num_kv_heads: int, gen: torch.Generator) -> Tensor | None:
    """FP8 scales `[2, num_kv_heads]`: "pow2" (as the engine calibrates them; x / scale is exact) or "any"."""
    if scales is None:
        return None
    if scales == "pow2":
        return 2.0 ** torch.randint(-7, -2, (2, num_kv_heads), generator=gen).float()
    return torch.rand(2, num_kv_heads, generator=gen) * 0.05 + 0.005


def _paged_kv_case(tokens: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                   pool_dtype: torch.dtype, gen: torch.Generator, device: str = "cpu", scales: str | None = None,
                   halves: bool = False) -> PagedKV:
    """A random pool (so a value not written stays visibly old) and distinct random slots, about a fifth of
    them negative (padding tokens, skipped). scales: an FP8 pool's (_kv_scales). halves: the pool as the page
    view `[num_pages, 2, page_size, num_kv_heads, head_dim]` of a layer holding every page's K, then every V."""
    pool = randn((num_pages, 2 * page_size * num_kv_heads * head_dim), pool_dtype, gen, "cpu").to(device)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.2] = -1
    kv_scales = _kv_scales(scales, num_kv_heads, gen)
    if halves:
        pool = reference.kv_page_view(pool, page_size, num_kv_heads).transpose(0, 1).contiguous().transpose(0, 1)
    return PagedKV(pool, slots.to(torch.int32).to(device), page_size,
                   None if kv_scales is None else kv_scales.to(device))


def _e4m3_order(codes: Tensor) -> Tensor:
    """float8_e4m3fn codes (as uint8) numbered in the order of their values, both zeros 0: adjacent values
    differ by 1."""
    magnitude = (codes & 0x7F).int()
    return torch.where(codes >= 0x80, -magnitude, magnitude)


def _assert_pools_match(got: Tensor, want: Tensor, exact: bool = True) -> None:
    """Equal pools; FP8 ones compared by their bytes, or (exact=False) at most one rounding step apart."""
    if got.dtype != torch.float8_e4m3fn:
        assert torch.equal(got, want)
        return
    got_codes, want_codes = got.view(torch.uint8), want.view(torch.uint8)
    if exact:
        assert torch.equal(got_codes, want_codes), f"{int((got_codes != want_codes).sum())} FP8 values differ"
        return
    steps = (_e4m3_order(got_codes) - _e4m3_order(want_codes)).abs()
    assert steps.max().item() <= 1, f"{int((steps > 1).sum())} FP8 values more than one rounding step away"


def _check_rotary_store(heads: tuple[int, int, int], dtype: torch.dtype, page_size: int, seed: int,
                        pool_dtype: torch.dtype | None = None, with_delta: bool = False, device: str = "cpu",
                        pdl: bool = False, tokens: int = 13, scales: str | None = None, halves: bool = False) -> None:
    """The kernel's qkv and pool against the reference's (rotary, then store_kv of the rotated k and of v).
    scales, halves: an FP8 pool's scales and the pool's layout (_paged_kv_case); with scales "any" the FP8
    values may be one rounding step apart."""
    wide, qkv, cos, sin = _rotary_case(tokens, *heads, dtype, seed=seed, device=device)
    gen = make_generator(seed + 1)
    kv = _paged_kv_case(tokens, 2 * tokens // page_size + 3, page_size, heads[1], heads[2], pool_dtype or dtype,
                        gen, device, scales, halves)
    delta, slots = _delta_case(qkv, gen) if with_delta else (None, None)
    expected, expected_pool = wide.clone(), kv.kv_pool.clone()
    start = qkv.storage_offset() - wide.storage_offset()
    reference.rotary_qk_(expected[:, start:start + qkv.shape[1]], cos, sin, *heads, delta, slots,
                         kv._replace(kv_pool=expected_pool))
    rotary_qk_(qkv, cos, sin, *heads, delta=delta, token_slots=slots, kv=kv, pdl=pdl)
    assert torch.equal(wide, expected)
    _assert_pools_match(kv.kv_pool, expected_pool, exact=scales != "any")


def test_reference_rotary_stores_the_rotated_keys_and_the_values():
    heads = (4, 2, 16)
    _, qkv, cos, sin = _rotary_case(5, *heads, torch.float32, seed=40)
    kv = _paged_kv_case(5, 3, 8, 2, 16, torch.float32, make_generator(41))
    kv = kv._replace(kv_locations=torch.tensor([0, 9, -1, 23, 4], dtype=torch.int32))
    before = kv.kv_pool.clone()
    reference.rotary_qk_(qkv, cos, sin, *heads, kv=kv)
    pages = reference.kv_page_view(kv.kv_pool, 8, 2)                 # [pages, 2, page_size, kv_heads, head_dim]
    key, value = qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].view(5, 2, 16)
    for token, slot in enumerate([0, 9, 23, 4]):
        row = token if token < 2 else token + 1
        assert torch.equal(pages[slot // 8, 0, slot % 8], key[row])
        assert torch.equal(pages[slot // 8, 1, slot % 8], value[row])
    written = reference.kv_page_view(before, 8, 2) != pages
    assert written.any(dim=(3, 4)).sum() == 8                         # 4 tokens' K and V rows, nothing else


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, None), (torch.float16, None),
                                              (torch.float16, torch.float32), (torch.float32, torch.float16)])
@pytest.mark.parametrize("page_size", [8, 32])
@pytest.mark.parametrize("heads", [(4, 1, 16), (2, 2, 32), (6, 3, 16)])
def test_rotary_qk_stores_kv_like_the_reference(dtype, pool_dtype, page_size, heads):
    _check_rotary_store(heads, dtype, page_size, seed=page_size + heads[2], pool_dtype=pool_dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rotary_qk_stores_kv_with_the_lora_delta(dtype):
    _check_rotary_store((4, 2, 16), dtype, 16, seed=42, with_delta=True)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rotary_qk_stores_kv_across_head_blocks(dtype, monkeypatch):
    # Two heads per program: 4 q, 2 k and 2 v heads give 4 programs per token, the k/v heads in the last two.
    monkeypatch.setattr(fused_ops, "ROTARY_BLOCK_ELEMS", 32)
    _check_rotary_store((4, 2, 16), dtype, 8, seed=43)
    _check_rotary_store((4, 2, 16), dtype, 8, seed=44, with_delta=True)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_rotary_qk_stores_kv_of_k_and_v_alone(dtype, with_delta):
    _check_rotary_store((0, 2, 16), dtype, 8, seed=47, with_delta=with_delta)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("scales", ["pow2", "any"])
def test_rotary_qk_stores_kv_into_an_fp8_pool(dtype, scales):
    # Scales of 2**-7 .. 2**-3 over rotated keys of up to about 8: some saturate at 448.
    _check_rotary_store((4, 2, 16), dtype, 8, seed=50, pool_dtype=torch.float8_e4m3fn, scales=scales)


def test_rotary_qk_stores_kv_into_an_fp8_pool_across_head_blocks(monkeypatch):
    # Two heads per program: the k and v heads (and their scales) in the last two programs, with a delta.
    monkeypatch.setattr(fused_ops, "ROTARY_BLOCK_ELEMS", 32)
    _check_rotary_store((4, 2, 16), torch.float16, 8, seed=51, pool_dtype=torch.float8_e4m3fn, scales="pow2",
                        with_delta=True)


@pytest.mark.parametrize("pool_dtype,scales", [(torch.float16, None), (torch.float8_e4m3fn, "pow2")])
def test_rotary_qk_stores_kv_into_k_and_v_halves(pool_dtype, scales):
    _check_rotary_store((4, 2, 16), torch.float16, 8, seed=52, pool_dtype=pool_dtype, scales=scales, halves=True)


def _check_fp8_rounding(device: str) -> None:
    """Keys and values on every rounding tie of E4M3 (to even), on its values, past 448 (saturated), below its
    smallest subnormal, and zeros of both signs: stored as torch's conversion stores them. cos 1 and sin 0
    leave the keys as they are."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[~codes.isnan()].sort().values                                     # 254 finite values
    ties = (values[1:] + values[:-1]) / 2
    extremes = torch.tensor([449.0, 463.9, 464.0, 1e6, 1e30, 2.0 ** -10, 2.0 ** -11, 0.0, -0.0])
    special = torch.cat([ties, values, extremes, -ties, -extremes])
    special = torch.cat([special, torch.zeros(-len(special) % 64)])                # [tokens * 2 * 32]
    tokens = len(special) // 64
    kv_scales = torch.tensor([[0.25, 2.0], [0.125, 1.0]], device=device)            # [2, 2]: K's, V's
    # qkv [tokens, (k heads, v heads) 2 * 2 * 16]: each head holds the values times its scale.
    qkv = (special.to(device).view(tokens, 4, 16) * kv_scales.flatten()[None, :, None]).flatten(1)
    cos, sin = torch.ones(tokens, 16, device=device), torch.zeros(tokens, 16, device=device)
    kv = PagedKV(torch.zeros(tokens // 8 + 1, 2 * 8 * 2 * 16, dtype=torch.float8_e4m3fn, device=device),
                 torch.arange(tokens, dtype=torch.int32, device=device), 8, kv_scales)
    expected_pool = kv.kv_pool.clone()
    reference.rotary_qk_(qkv.clone(), cos, sin, 0, 2, 16, kv=kv._replace(kv_pool=expected_pool))
    rotary_qk_(qkv, cos, sin, 0, 2, 16, kv=kv)
    _assert_pools_match(kv.kv_pool, expected_pool)


def test_rotary_qk_rounds_to_fp8_as_torch_does():
    _check_fp8_rounding("cpu")


def test_rotary_qk_of_q_alone_has_nothing_to_store():
    _, qkv, cos, sin = _rotary_case(4, 4, 0, 16, torch.float32, seed=48)
    kv = PagedKV(torch.zeros(2, 0), torch.zeros(4, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="num_kv_heads must be positive with kv"):
        rotary_qk_(qkv, cos, sin, 4, 0, 16, kv=kv)


def test_rotary_qk_stores_kv_with_int64_slots_and_no_tokens():
    wide, qkv, cos, sin = _rotary_case(6, 4, 1, 16, torch.float32, seed=45)
    kv = _paged_kv_case(6, 3, 8, 1, 16, torch.float32, make_generator(46))
    kv = kv._replace(kv_locations=kv.kv_locations.long())
    expected_pool = kv.kv_pool.clone()
    reference.rotary_qk_(qkv.clone(), cos, sin, 4, 1, 16, kv=kv._replace(kv_pool=expected_pool))
    rotary_qk_(qkv, cos, sin, 4, 1, 16, kv=kv)
    assert torch.equal(kv.kv_pool, expected_pool)
    rotary_qk_(qkv[:0], cos[:0], sin[:0], 4, 1, 16, kv=kv._replace(kv_locations=kv.kv_locations[:0]))
    assert torch.equal(kv.kv_pool, expected_pool)


@pytest.mark.parametrize("change,match", [
    (lambda kv: kv._replace(kv_pool=kv.kv_pool[:, :-2]), "kv_pool must be"),
    (lambda kv: kv._replace(kv_pool=kv.kv_pool[0]), "kv_pool must be"),
    (lambda kv: kv._replace(page_size=0), "page_size must be positive"),
    (lambda kv: kv._replace(kv_locations=kv.kv_locations[:-1]), "kv_locations must be"),
    (lambda kv: kv._replace(kv_locations=kv.kv_locations.float()), "int32 or int64"),
    (lambda kv: kv._replace(kv_locations=torch.stack([kv.kv_locations] * 2, 1)[:, 0]), "must be contiguous"),
    (lambda kv: kv._replace(kv_pool=torch.stack([kv.kv_pool] * 2, 2)[:, :, 0]), "kv_pool must be contiguous"),
    (lambda kv: kv._replace(kv_pool=kv.kv_pool.long()), "kv_pool must be float16"),
    (lambda kv: kv._replace(kv_pool=_meta(kv.kv_pool)), "one device"),
    (lambda kv: kv._replace(kv_pool=kv.kv_pool.view(-1, 2, 8, 1, 16)[:, :, ::2]), "num_kv_heads, head_dim\\] = "),
    (lambda kv: kv._replace(kv_pool=kv.kv_pool.view(-1, 2, 16, 1, 8).transpose(2, 4)), "contiguous in its last"),
    (lambda kv: kv._replace(kv_pool=kv.kv_pool.to(torch.float8_e5m2)), "must be float8_e4m3fn"),
])
def test_rotary_qk_rejects_a_bad_pool(change, match):
    _, qkv, cos, sin = _rotary_case(4, 4, 1, 16, torch.float32, seed=47)
    kv = change(_paged_kv_case(4, 2, 8, 1, 16, torch.float32, make_generator(48)))
    with pytest.raises(ValueError, match=match):
        rotary_qk_(qkv, cos, sin, 4, 1, 16, kv=kv)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rotary_qk_stores_kv_gpu(dtype, page_size, with_delta):
    pdl = has_pdl()
    _check_rotary_store((32, 8, 128), dtype, page_size, seed=49, with_delta=with_delta, device="cuda", pdl=pdl,
                        tokens=3000)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("pool_dtype,scales,halves", [(torch.float8_e4m3fn, "pow2", False),
                                                      (torch.float8_e4m3fn, "any", False),
                                                      (None, None, True), (torch.float8_e4m3fn, "pow2", True)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rotary_qk_stores_kv_gpu_fp8_and_halves(dtype, pool_dtype, scales, halves):
    if scales and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 (e4m3) conversions need compute capability 8.9")
    _check_rotary_store((32, 8, 128), dtype, 16, seed=53, pool_dtype=pool_dtype, with_delta=True, device="cuda",
                        pdl=has_pdl(), tokens=3000, scales=scales, halves=halves)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rotary_qk_rounds_to_fp8_as_torch_does_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 (e4m3) conversions need compute capability 8.9")
    _check_fp8_rounding("cuda")
