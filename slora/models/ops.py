"""The elementwise parts of a decoder layer: fused Triton kernels on CUDA, their torch references
elsewhere. On the GPU a decode step of a few rows per projection is bound by launches: with the torch
versions a Llama-3-8B decode step ran 943 kernels, with the fused ones 365 (about 18 fewer per layer).
pdl: the CUDA kernels launch with programmatic dependent launch (slora.kernels.pdl); the references
have no launches, so it does not reach them."""
from collections.abc import Callable

from torch import Tensor

from slora.kernels import reference


def _kernel(name: str, x: Tensor, pdl: bool) -> Callable:
    """The implementation of op `name` for x's device."""
    if x.is_cuda:
        from slora.kernels import fused_ops
        return lambda *args: getattr(fused_ops, name)(*args, pdl=pdl)
    return getattr(reference, name)


def add_rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
                 pdl: bool = False) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); without residual, (RMSNorm(x) * weight, x)."""
    return _kernel("add_rms_norm", x, pdl)(x, weight, eps, residual)


def rotary_qk_(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
               pdl: bool = False) -> None:
    """Rotate the q and k heads of the fused q/k/v output `[tokens, (heads + 2 kv_heads) * head_dim]` in place."""
    _kernel("rotary_qk_", qkv, pdl)(qkv, cos, sin, num_heads, num_kv_heads, head_dim)


def silu_and_mul(gate_up: Tensor, pdl: bool = False) -> Tensor:
    """silu(gate) * up of the fused gate/up output `[tokens, 2 * intermediate]`."""
    return _kernel("silu_and_mul", gate_up, pdl)(gate_up)
