"""Fused Triton kernels for the elementwise work of a decoder layer: RMSNorm, rotary embedding of q and k
inside the fused qkv output (storing the new K/V into the pool in the same launch), and SiLU(gate) * up.

Same signatures and semantics as `rms_norm`, `rotary_qk_` and `silu_and_mul` of
`slora.kernels.reference`, plus `pdl` (programmatic dependent launch, `slora.kernels.pdl`: the
weight, cos and sin are read before waiting for the previous kernel, the activations after). Each takes
an optional LoRA `delta` (same shape as its input) and the step's `token_slots`: the input rows of
tokens with an adapter (slot >= 0) get their delta added (rounded to the dtype) before the op, so that
the LoRA can be computed beside the base GEMM (`lora_expand(add=False)`) and added here without a
launch of its own. Each kernel replaces a chain of small torch ops by one launch; to give the same
numbers, every kernel computes in float32 but rounds to the input dtype wherever a torch op of the
reference would produce a tensor of that dtype.

The rotary kernel's store into an FP8 pool (float8_e4m3fn, with per-KV-head scales) divides by the scale
(IEEE-rounded, as torch divides), clamps to +-448 and rounds to E4M3 in float32 before converting: the
conversion then only meets exactly representable values, which every backend converts alike (the Triton
interpreter rounds inexact ones wrongly, e.g. 1.9427 to 1.0).
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from slora.kernels.checks import check_kv_pool, check_kv_scales, check_one_device, is_power_of_two
from slora.kernels.layout import cdiv, next_power_of_2
from slora.kernels.pdl import check_pdl_supported, launch_options, pdl_start, pdl_wait
from slora.kernels.reference import FP8_MAX, PagedKV, kv_page_view

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_POOL_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)
MAX_HIDDEN = 16384             # rms_norm holds a whole row in registers
SILU_BLOCK = 1024              # columns of silu_and_mul per program
ROTARY_BLOCK_ELEMS = 2048      # about this many qkv elements per rotary program
_FP8_MAX = tl.constexpr(FP8_MAX)
_FLOAT32_SIGN = tl.constexpr(-(2 ** 31))   # the sign bit of a float32, as an int32


@triton.jit
def _with_delta(x, delta_ptr, slots_ptr, token, offsets, mask, dtype: tl.constexpr):
    # x (float32, values of dtype) plus the token's LoRA delta at `offsets` of its row, rounded to dtype. Rows
    # of tokens without adapter (slot -1) hold no delta (never written): nothing is read, and x + 0 is x.
    has_adapter = (tl.zeros_like(offsets) + tl.load(slots_ptr + token)) >= 0   # the row's slot, as a tensor
    delta = tl.load(delta_ptr + offsets, mask=mask & has_adapter, other=0.0).to(tl.float32)
    return (x + delta).to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, sum_ptr, delta_ptr, slots_ptr,
    stride_x, stride_d, hidden, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program per row: x [hidden] (+ its LoRA delta), normalised, times weight [hidden].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    pdl_start(USE_PDL)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = _with_delta(x, delta_ptr, slots_ptr, row, row * stride_d + cols, mask, dtype)
        tl.store(sum_ptr + row * hidden + cols, x.to(dtype), mask=mask)
    # Masked columns are 0, so they add nothing to the sum of squares.
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)       # the reference's rms_norm(...).to(dtype)
    tl.store(out_ptr + row * hidden + cols, (weight * normed).to(dtype), mask=mask)


# The FP8 scales' alignment is not specialised: each layer passes its row of the model's [layers, 2, kv_heads]
# scales, 16-byte aligned or not, and the kernel loads one scale per head.
@triton.jit(do_not_specialize=["scales_ptr"])
def _rotary_qk_kernel(
    qkv_ptr, cos_ptr, sin_ptr, delta_ptr, slots_ptr, pool_ptr, kv_locations_ptr, scales_ptr,
    stride_qkv, stride_cos, stride_sin, stride_d, num_heads, covered_heads, page_stride, v_offset,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_KV: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, QUANTIZE: tl.constexpr,
):
    # Program (token, head block): rotates BLOCK_H heads [BLOCK_H, HEAD_DIM] of the q and k columns (q heads
    # then k heads, num_heads + NUM_KV_HEADS in all) in place, as two halves [BLOCK_H, HALF]. The programs
    # cover `covered_heads` heads: with a delta or HAS_KV, v's heads too, which are not rotated; with a delta
    # they get it added in place. HAS_KV: the k and v heads are stored into the token's location in the pool too,
    # quantized by the heads' scales (scales_ptr, [2, NUM_KV_HEADS]) when QUANTIZE (an FP8 pool).
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = (heads < covered_heads)[:, None]
    dtype = qkv_ptr.dtype.element_ty
    pdl_start(USE_PDL)
    # cos/sin [HALF] of each half, shared by every head of the token.
    cos1 = tl.load(cos_ptr + token * stride_cos + dims).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + token * stride_cos + HALF + dims).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + token * stride_sin + dims).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + token * stride_sin + HALF + dims).to(tl.float32)[None, :]
    if HAS_KV:
        location = tl.load(kv_locations_ptr + token).to(tl.int64)    # the host's: no kernel before writes it
    pdl_wait(USE_PDL)
    first = qkv_ptr + token * stride_qkv + heads[:, None] * HEAD_DIM + dims[None, :]
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    if HAS_DELTA:
        offsets = token * stride_d + heads[:, None] * HEAD_DIM + dims[None, :]
        x1 = _with_delta(x1, delta_ptr, slots_ptr, token, offsets, mask, dtype)
        x2 = _with_delta(x2, delta_ptr, slots_ptr, token, offsets + HALF, mask, dtype)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to dtype as the torch ops do.
    out1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    rotates = (heads < num_heads + NUM_KV_HEADS)[:, None]   # v heads: their delta only
    out1 = tl.where(rotates, out1, x1).to(dtype)
    out2 = tl.where(rotates, out2, x2).to(dtype)
    # Without a delta the v columns are unchanged: not written back.
    written = mask if HAS_DELTA else mask & rotates
    tl.store(first, out1, mask=written)
    tl.store(first + HALF, out2, mask=written)
    if HAS_KV:
        _store_to_page(pool_ptr, scales_ptr, location, heads - num_heads, dims, out1, out2, mask, page_stride,
                       v_offset, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, QUANTIZE)


@triton.jit
def _store_to_page(pool_ptr, scales_ptr, location, kv_heads, dims, half1, half2, mask, page_stride, v_offset,
                   PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   QUANTIZE: tl.constexpr):
    # Heads [BLOCK_H] numbered from the first k head (k heads, then v heads; others masked) of one token,
    # both halves [BLOCK_H, HALF] (in qkv's dtype, as the reference stores them), into its location; a negative
    # location (a padding token) stores nothing. A page is [2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM] viewed with
    # `page_stride` elements from one page to the next and `v_offset` from its K to its V; int64 because a
    # layer of a large pool may hold more than 2**31 elements. QUANTIZE: divided by the head's scale and
    # rounded to E4M3 (an FP8 pool); the scales [2, NUM_KV_HEADS] are numbered as kv_heads are.
    HALF: tl.constexpr = HEAD_DIM // 2
    is_v = kv_heads >= NUM_KV_HEADS
    head = tl.where(is_v, kv_heads - NUM_KV_HEADS, kv_heads)
    row = (location // PAGE_SIZE) * page_stride + (location % PAGE_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
    base = row + tl.where(is_v, v_offset, 0) + head * HEAD_DIM                      # [BLOCK_H]
    dst = pool_ptr + base[:, None] + dims[None, :]
    stores = (kv_heads >= 0) & ((tl.zeros_like(kv_heads) + location) >= 0)   # the location, as a tensor
    keep = mask & stores[:, None]
    elem = pool_ptr.dtype.element_ty
    if QUANTIZE:
        scale = tl.load(scales_ptr + kv_heads, mask=stores & (kv_heads < 2 * NUM_KV_HEADS), other=1.0)[:, None]
        half1 = _quantize_e4m3(half1.to(tl.float32), scale)
        half2 = _quantize_e4m3(half2.to(tl.float32), scale)
    tl.store(dst, half1.to(elem), mask=keep)
    tl.store(dst + HALF, half2.to(elem), mask=keep)


@triton.jit
def _quantize_e4m3(x, scale):
    # x / scale (float32, IEEE-rounded like torch's division) clamped to +-FP8_MAX and rounded to the nearest
    # E4M3 value, ties to even, still in float32: E4M3 has 3 mantissa bits, so the values around |y| in
    # [2**e, 2**(e + 1)) are 2**(e - 3) apart, and 2**-9 apart below its smallest normal 2**-6. Adding and
    # subtracting 1.5 * 2**23 rounds |y| / spacing (< 16) to an integer in float32's own rounding (to
    # nearest even). The sign bit is put back afterwards: -0.0, and negatives that round to zero, become
    # E4M3's negative zero, as torch's conversion gives.
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)
    bits = y.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    spacing_exp = tl.maximum(exponent, -6) - 3                                    # in [-9, 5]
    spacing = ((spacing_exp + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - spacing_exp) << 23).to(tl.float32, bitcast=True)          # exact: both powers of two
    magic = 12582912.0                                                            # 1.5 * 2**23
    rounded = ((tl.abs(y) * inverse + magic) - magic) * spacing
    return (rounded.to(tl.int32, bitcast=True) | (bits & _FLOAT32_SIGN)).to(tl.float32, bitcast=True)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, delta_ptr, slots_ptr, stride_in, stride_d, inter,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr, HAS_DELTA: tl.constexpr,
):
    # Program (token, column block): out[token, cols] = silu(gate[cols]) * up[cols], where gate is
    # columns [0, inter) and up columns [inter, 2 * inter) of the input row.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    gate = tl.load(gate_up_ptr + token * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        gate = _with_delta(gate, delta_ptr, slots_ptr, token, token * stride_d + cols, mask, dtype)
        up = _with_delta(up, delta_ptr, slots_ptr, token, token * stride_d + inter + cols, mask, dtype)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)   # F.silu's result in dtype
    tl.store(out_ptr + token * inter + cols, (silu * up).to(dtype), mask=mask)


def _check_float_dtype(name: str, tensor: Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def _check_last_dim_contiguous(**tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {tensor.stride()}")


def _check_same_dtype(reference_name: str, reference: Tensor, **tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype != reference.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from {reference_name} dtype {reference.dtype}")


def _check_delta(name: str, x: Tensor, delta: Tensor | None, token_slots: Tensor | None) -> None:
    """A LoRA delta comes with the step's token slots, and has x's shape and dtype."""
    if (delta is None) != (token_slots is None):
        raise ValueError("delta and token_slots go together: give both or neither")
    if delta is None:
        return
    assert token_slots is not None, "given with delta: checked above"
    if delta.shape != x.shape:
        raise ValueError(f"delta shape {tuple(delta.shape)} differs from {name} shape {tuple(x.shape)}")
    if token_slots.shape != (x.shape[0],) or token_slots.dtype != torch.int32:
        raise ValueError(f"token_slots must be int32 [tokens={x.shape[0]}], got {token_slots.dtype} of shape "
                         f"{tuple(token_slots.shape)}")
    if token_slots.shape[0] > 1 and token_slots.stride(0) != 1:
        raise ValueError(f"token_slots must be contiguous, got stride {token_slots.stride(0)}")
    _check_same_dtype(name, x, delta=delta)
    check_one_device(**{name: x}, delta=delta, token_slots=token_slots)
    _check_last_dim_contiguous(delta=delta)


def _delta_args(x: Tensor, delta: Tensor | None, token_slots: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """(delta, token_slots, delta's row stride) for a launch; x and 0 stand in when there is no delta."""
    if delta is None:
        return x, x, 0
    assert token_slots is not None, "_check_delta: delta and token_slots go together"
    return delta, token_slots, delta.stride(0)


def _check_rms_norm_inputs(x: Tensor, weight: Tensor, eps: float) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden must be in [1, {MAX_HIDDEN}], got {hidden}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [hidden={hidden}], got shape {tuple(weight.shape)}")
    if eps < 0:
        raise ValueError(f"eps must be non-negative, got {eps}")
    _check_float_dtype("x", x)
    _check_same_dtype("x", x, weight=weight)
    check_one_device(x=x, weight=weight)
    _check_last_dim_contiguous(x=x, weight=weight)


def _rms_norm_warps(block: int) -> int:
    # About 8 to 16 elements per thread for wide rows, 4 warps at least.
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, delta: Tensor | None = None,
             token_slots: Tensor | None = None, pdl: bool = False) -> tuple[Tensor, Tensor]:
    """(weight * rms_norm(x + delta), x + delta) for x `[tokens, hidden]` and weight `[hidden]`, delta
    added in the rows of tokens with an adapter (see the module's note); without delta, the second item is
    `x` itself, else a new contiguous tensor, as the first item always is."""
    _check_rms_norm_inputs(x, weight, eps)
    _check_delta("x", x, delta, token_slots)
    check_pdl_supported(pdl, x.device)
    tokens, hidden = x.shape
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    summed = x if delta is None else torch.empty_like(out)
    if tokens == 0:
        return out, summed
    block = next_power_of_2(hidden)
    delta, slots, stride_d = _delta_args(x, delta, token_slots)
    _rms_norm_kernel[(tokens,)](
        x, weight, out, summed, delta, slots, x.stride(0), stride_d, hidden, eps,
        HAS_DELTA=token_slots is not None, BLOCK=block, USE_PDL=pdl,
        num_warps=_rms_norm_warps(block), **launch_options(pdl),
    )
    return out, summed


def _check_rotary_inputs(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> None:
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [tokens, (num_heads + 2 * num_kv_heads) * head_dim], "
                         f"got shape {tuple(qkv.shape)}")
    # Either count may be 0 (a projection's q columns alone, or its k/v columns alone), not both.
    if min(num_heads, num_kv_heads) < 0 or num_heads + num_kv_heads == 0 or \
            (num_heads and num_kv_heads and num_heads % num_kv_heads):
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}, or either "
                         "of them 0 (q alone, or k and v alone), not both")
    if not is_power_of_two(head_dim) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, (num_heads + 2 * num_kv_heads) * head_dim "
                         f"= {width}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (qkv.shape[0], head_dim):
            raise ValueError(f"{name} must be [tokens={qkv.shape[0]}, head_dim={head_dim}], "
                             f"got shape {tuple(table.shape)}")
    _check_float_dtype("qkv", qkv)
    _check_same_dtype("qkv", qkv, cos=cos, sin=sin)
    check_one_device(qkv=qkv, cos=cos, sin=sin)
    _check_last_dim_contiguous(qkv=qkv, cos=cos, sin=sin)


def _check_paged_kv(qkv: Tensor, kv: PagedKV, num_kv_heads: int, head_dim: int) -> None:
    kv_pool, kv_locations, page_size, kv_scales = kv
    if num_kv_heads == 0:
        raise ValueError("kv stores k and v heads: num_kv_heads must be positive with kv")
    check_kv_pool(kv_pool, page_size, num_kv_heads, head_dim)
    if kv_locations.shape != (qkv.shape[0],) or kv_locations.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_locations must be int32 or int64 [tokens={qkv.shape[0]}], got "
                         f"{kv_locations.dtype} of shape {tuple(kv_locations.shape)}")
    if not kv_locations.is_contiguous():
        raise ValueError("kv_locations must be contiguous")
    if kv_pool.dtype not in KV_POOL_DTYPES:
        raise ValueError(f"kv_pool must be float16, bfloat16, float32 or float8_e4m3fn, got {kv_pool.dtype}")
    check_kv_scales(kv_pool, kv_scales, num_kv_heads)
    check_one_device(qkv=qkv, kv_pool=kv_pool, kv_locations=kv_locations)


def _store_args(qkv: Tensor, kv: PagedKV | None,
                num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor, int, int, int]:
    """(pool, kv_locations, scales, page stride, K-to-V offset, page_size) of the rotary kernel's store; without
    kv, qkv and zeros stand in (the kernel reads none of them)."""
    if kv is None:
        return qkv, qkv, qkv, 0, 0, 1
    pages = kv_page_view(kv.kv_pool, kv.page_size, num_kv_heads)   # [num_pages, 2, page_size, kv_heads, head_dim]
    scales = pages if kv.kv_scales is None else kv.kv_scales
    return pages, kv.kv_locations, scales, pages.stride(0), pages.stride(1), kv.page_size


def rotary_qk_(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, *,
               delta: Tensor | None = None, token_slots: Tensor | None = None, kv: PagedKV | None = None,
               pdl: bool = False) -> None:
    """Rotate the q and k heads of qkv `[tokens, (num_heads + 2 * num_kv_heads) * head_dim]` in place
    by cos/sin `[tokens, head_dim]` (the half-split layout of HF Llama); without delta, the v columns are
    untouched. num_heads 0: qkv holds k and v alone; num_kv_heads 0: q alone. delta: added to all of q, k
    and v first in the rows of tokens with an adapter (the module's note), so the v columns then hold
    v + delta. kv: every token's k (rotated) and v are also written into its location in the pool, a negative
    location skipped, in the same launch; its pool is `[num_pages, page_elems]` contiguous or the page view
    `[num_pages, 2, page_size, num_kv_heads, head_dim]` with free page and K/V strides, and an FP8 one
    (float8_e4m3fn, with kv.kv_scales) gets them quantized as `slora.kernels.reference.store_kv` does."""
    _check_rotary_inputs(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    _check_delta("qkv", qkv, delta, token_slots)
    if kv is not None:
        _check_paged_kv(qkv, kv, num_kv_heads, head_dim)
    check_pdl_supported(pdl, qkv.device)
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    rot_heads = num_heads + num_kv_heads
    # With a delta or a store, v's heads too.
    heads = rot_heads if delta is None and kv is None else rot_heads + num_kv_heads
    block_h = min(next_power_of_2(heads), max(1, ROTARY_BLOCK_ELEMS // head_dim))
    delta, slots, stride_d = _delta_args(qkv, delta, token_slots)
    pool, kv_locations, scales, page_stride, v_offset, page_size = _store_args(qkv, kv, num_kv_heads)
    # No FMA: the reference rounds x * cos before adding rot * sin (this matters in float32).
    _rotary_qk_kernel[(tokens, cdiv(heads, block_h))](
        qkv, cos, sin, delta, slots, pool, kv_locations, scales,
        qkv.stride(0), cos.stride(0), sin.stride(0), stride_d, num_heads, heads, page_stride, v_offset,
        HEAD_DIM=head_dim, BLOCK_H=block_h, USE_PDL=pdl, HAS_DELTA=token_slots is not None,
        HAS_KV=kv is not None, PAGE_SIZE=page_size, NUM_KV_HEADS=num_kv_heads,
        QUANTIZE=kv is not None and kv.kv_scales is not None,
        num_warps=4, enable_fp_fusion=False, **launch_options(pdl),
    )


def _check_silu_inputs(gate_up: Tensor) -> None:
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up must be [tokens, 2 * inter], got shape {tuple(gate_up.shape)}")
    if gate_up.shape[1] == 0 or gate_up.shape[1] % 2 != 0:
        raise ValueError(f"gate_up must have a positive even number of columns, got {gate_up.shape[1]}")
    _check_float_dtype("gate_up", gate_up)
    _check_last_dim_contiguous(gate_up=gate_up)


def silu_and_mul(gate_up: Tensor, *, delta: Tensor | None = None, token_slots: Tensor | None = None,
                 pdl: bool = False) -> Tensor:
    """silu(gate) * up for gate_up `[tokens, 2 * inter]` (gate columns first); returns a new
    contiguous `[tokens, inter]` tensor in gate_up's dtype. delta: added to gate_up first in the rows of
    tokens with an adapter (the module's note)."""
    _check_silu_inputs(gate_up)
    _check_delta("gate_up", gate_up, delta, token_slots)
    check_pdl_supported(pdl, gate_up.device)
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(SILU_BLOCK, next_power_of_2(inter))
    delta, slots, stride_d = _delta_args(gate_up, delta, token_slots)
    _silu_and_mul_kernel[(tokens, cdiv(inter, block))](
        gate_up, out, delta, slots, gate_up.stride(0), stride_d, inter,
        BLOCK=block, USE_PDL=pdl, HAS_DELTA=token_slots is not None, num_warps=4, **launch_options(pdl),
    )
    return out
