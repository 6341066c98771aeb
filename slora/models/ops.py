"""The elementwise parts of a decoder layer: fused Triton kernels on CUDA, their torch references
elsewhere. On the GPU a decode step of a few rows per projection is bound by launches: with the torch
versions a Llama-3-8B decode step ran 943 kernels, with the fused ones 365 (about 18 fewer per layer)."""
from torch import Tensor

from slora.kernels import reference


def _kernels(x: Tensor):
    """The module that implements these ops for x's device."""
    if x.is_cuda:
        from slora.kernels import fused_ops
        return fused_ops
    return reference


def add_rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); without residual, (RMSNorm(x) * weight, x)."""
    return _kernels(x).add_rms_norm(x, weight, eps, residual)


def rotary_qk_(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Rotate the q and k heads of the fused q/k/v output `[tokens, (heads + 2 kv_heads) * head_dim]` in place."""
    _kernels(qkv).rotary_qk_(qkv, cos, sin, num_heads, num_kv_heads, head_dim)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of the fused gate/up output `[tokens, 2 * intermediate]`."""
    return _kernels(gate_up).silu_and_mul(gate_up)
