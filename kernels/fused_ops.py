"""Fused Triton kernels for the elementwise work of a decoder layer: residual add + RMSNorm, rotary
embedding of q and k inside the fused qkv output, and SiLU(gate) * up.

Same signatures and semantics as `add_rms_norm`, `rotary_qk_` and `silu_and_mul` of
`slora.kernels.reference`, plus `pdl` (programmatic dependent launch, `slora.kernels.pdl`: the
weight, cos and sin are read before waiting for the previous kernel, the activations after). Each
replaces a chain of small torch ops by one launch; to give the same numbers, every kernel computes in
float32 but rounds to the input dtype wherever a torch op of the reference would produce a tensor of
that dtype.
"""
import torch
import triton
import triton.language as tl
from slora.kernels.checks import check_one_device, is_power_of_two
from slora.kernels.layout import cdiv, next_power_of_2
from slora.kernels.pdl import check_pdl_supported, launch_options, pdl_start, pdl_wait
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 16384             # add_rms_norm holds a whole row in registers
SILU_BLOCK = 1024              # columns of silu_and_mul per program
ROTARY_BLOCK_ELEMS = 2048      # about this many qkv elements per rotary program


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program per row: x [hidden] (+ residual), normalised, times weight [hidden].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    pdl_start(USE_PDL)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(dtype)              # the reference adds in x's dtype
        tl.store(sum_ptr + row * hidden + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    # Masked columns are 0, so they add nothing to the sum of squares.
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)       # the reference's rms_norm(...).to(dtype)
    tl.store(out_ptr + row * hidden + cols, (weight * normed).to(dtype), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    qkv_ptr, cos_ptr, sin_ptr,
    stride_qkv, stride_cos, stride_sin, rot_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (token, head block): rotates BLOCK_H heads [BLOCK_H, HEAD_DIM] of the q and k columns
    # (q heads then k heads, `rot_heads` in all) in place, as two halves [BLOCK_H, HALF].
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = (heads < rot_heads)[:, None]
    dtype = qkv_ptr.dtype.element_ty
    pdl_start(USE_PDL)
    # cos/sin [HALF] of each half, shared by every head of the token.
    cos1 = tl.load(cos_ptr + token * stride_cos + dims).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + token * stride_cos + HALF + dims).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + token * stride_sin + dims).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + token * stride_sin + HALF + dims).to(tl.float32)[None, :]
    pdl_wait(USE_PDL)
    first = qkv_ptr + token * stride_qkv + heads[:, None] * HEAD_DIM + dims[None, :]
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to dtype as the torch ops do.
    out1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, inter,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
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


def _check_rms_norm_inputs(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden must be in [1, {MAX_HIDDEN}], got {hidden}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [hidden={hidden}], got shape {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    if eps < 0:
        raise ValueError(f"eps must be non-negative, got {eps}")
    others = {"weight": weight} if residual is None else {"weight": weight, "residual": residual}
    _check_float_dtype("x", x)
    _check_same_dtype("x", x, **others)
    check_one_device(x=x, **others)
    _check_last_dim_contiguous(x=x, **others)


def _rms_norm_warps(block: int) -> int:
    # About 8 to 16 elements per thread for wide rows, 4 warps at least.
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def add_rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, *,
                 pdl: bool = False) -> tuple[Tensor, Tensor]:
    """(weight * rms_norm(x + residual), x + residual) for x, residual `[tokens, hidden]` and weight
    `[hidden]`; without residual, the second item is `x` itself. Outputs are new contiguous tensors."""
    _check_rms_norm_inputs(x, weight, eps, residual)
    check_pdl_supported(pdl, x.device)
    tokens, hidden = x.shape
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(out)
    if tokens == 0:
        return out, summed
    block = next_power_of_2(hidden)
    _add_rms_norm_kernel[(tokens,)](
        x, x if residual is None else residual, weight, out, summed,
        x.stride(0), x.stride(0) if residual is None else residual.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, USE_PDL=pdl,
        num_warps=_rms_norm_warps(block), **launch_options(pdl),
    )
    return out, summed


def _check_rotary_inputs(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> None:
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [tokens, (num_heads + 2 * num_kv_heads) * head_dim], "
                         f"got shape {tuple(qkv.shape)}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
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


def rotary_qk_(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, *,
               pdl: bool = False) -> None:
    """Rotate the q and k heads of qkv `[tokens, (num_heads + 2 * num_kv_heads) * head_dim]` in place
    by cos/sin `[tokens, head_dim]` (the half-split layout of HF Llama); the v columns are untouched."""
    _check_rotary_inputs(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    check_pdl_supported(pdl, qkv.device)
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    rot_heads = num_heads + num_kv_heads
    block_h = min(next_power_of_2(rot_heads), max(1, ROTARY_BLOCK_ELEMS // head_dim))
    # No FMA: the reference rounds x * cos before adding rot * sin (this matters in float32).
    _rotary_qk_kernel[(tokens, cdiv(rot_heads, block_h))](
        qkv, cos, sin,
        qkv.stride(0), cos.stride(0), sin.stride(0), rot_heads,
        HEAD_DIM=head_dim, BLOCK_H=block_h, USE_PDL=pdl,
        num_warps=4, enable_fp_fusion=False, **launch_options(pdl),
    )


def _check_silu_inputs(gate_up: Tensor) -> None:
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up must be [tokens, 2 * inter], got shape {tuple(gate_up.shape)}")
    if gate_up.shape[1] == 0 or gate_up.shape[1] % 2 != 0:
        raise ValueError(f"gate_up must have a positive even number of columns, got {gate_up.shape[1]}")
    _check_float_dtype("gate_up", gate_up)
    _check_last_dim_contiguous(gate_up=gate_up)


def silu_and_mul(gate_up: Tensor, *, pdl: bool = False) -> Tensor:
    """silu(gate) * up for gate_up `[tokens, 2 * inter]` (gate columns first); returns a new
    contiguous `[tokens, inter]` tensor in gate_up's dtype."""
    _check_silu_inputs(gate_up)
    check_pdl_supported(pdl, gate_up.device)
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(SILU_BLOCK, next_power_of_2(inter))
    _silu_and_mul_kernel[(tokens, cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter,
        BLOCK=block, USE_PDL=pdl, num_warps=4, **launch_options(pdl),
    )
    return out
