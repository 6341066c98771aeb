"""The elementwise parts of a decoder layer: fused Triton kernels on CUDA, their torch references
elsewhere. On the GPU a decode step of a few rows per projection is bound by launches: with the torch
versions a Llama-3-8B decode step ran 943 kernels, with the fused ones 365 (about 18 fewer per layer).
pdl: the CUDA kernels launch with programmatic dependent launch (slora.kernels.pdl)."""
from torch import Tensor

from slora.kernels import reference


def add_rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
                 pdl: bool = False) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); without residual, (RMSNorm(x) * weight, x)."""
    if x.is_cuda:
        from slora.kernels import fused_ops
        return fused_ops.add_rms_norm(x, weight, eps, residual, pdl=pdl)
    return reference.add_rms_norm(x, weight, eps, residual)


def rotary_qk_(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
               pdl: bool = False) -> None:
    """Rotate the q and k heads of the fused q/k/v output `[tokens, (heads + 2 kv_heads) * head_dim]` in place."""
    if qkv.is_cuda:
        from slora.kernels import fused_ops
        fused_ops.rotary_qk_(qkv, cos, sin, num_heads, num_kv_heads, head_dim, pdl=pdl)
    else:
        reference.rotary_qk_(qkv, cos, sin, num_heads, num_kv_heads, head_dim)


def silu_and_mul(gate_up: Tensor, pdl: bool = False) -> Tensor:
    """silu(gate) * up of the fused gate/up output `[tokens, 2 * intermediate]`."""
    if gate_up.is_cuda:
        from slora.kernels import fused_ops
        return fused_ops.silu_and_mul(gate_up, pdl=pdl)
    return reference.silu_and_mul(gate_up)
