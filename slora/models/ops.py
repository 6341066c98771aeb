"""The elementwise parts of a decoder layer: fused Triton kernels on CUDA, their torch references
elsewhere. On the GPU a decode step of a few rows per projection is bound by launches: with the torch
versions a Llama-3-8B decode step ran 943 kernels, with the fused ones 365 (about 18 fewer per layer).
pdl: the CUDA kernels launch with programmatic dependent launch (slora.kernels.pdl); the references
have no launches, so it does not reach them."""
from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from slora.kernels import reference
from slora.kernels.reference import PagedKV


class Delta(NamedTuple):
    """A projection's LoRA delta that the op reading the projection adds (rows of tokens with an adapter)."""
    delta: Tensor          # the projection's shape
    token_slots: Tensor    # [tokens] int32, -1 = no adapter (no delta)


def _kernel(name: str, x: Tensor, pdl: bool) -> Callable:
    """The implementation of op `name` for x's device."""
    if x.is_cuda:
        from slora.kernels import fused_ops
        return lambda *args, **kwargs: getattr(fused_ops, name)(*args, **kwargs, pdl=pdl)
    return getattr(reference, name)


def _delta_kwargs(lora: Delta | None) -> dict[str, Tensor]:
    return {} if lora is None else {"delta": lora.delta, "token_slots": lora.token_slots}


def rms_norm(x: Tensor, weight: Tensor, eps: float, pdl: bool = False,
             lora: Delta | None = None) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x) * weight, x). lora: x's LoRA delta, added to x first (then the second item is a new tensor
    holding x + delta)."""
    return _kernel("rms_norm", x, pdl)(x, weight, eps, **_delta_kwargs(lora))


def rotary_qk_(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
               kv: PagedKV | None, pdl: bool = False, lora: Delta | None = None) -> None:
    """Rotate the q and k heads of the fused q/k/v output `[tokens, (heads + 2 kv_heads) * head_dim]` in place
    (either count 0: q alone, or k and v alone) and store every token's k and v into its slot of the pool
    when kv is given (lora: the LoRA delta of these columns, added first)."""
    _kernel("rotary_qk_", qkv, pdl)(qkv, cos, sin, num_heads, num_kv_heads, head_dim, kv=kv,
                                    **_delta_kwargs(lora))


def silu_and_mul(gate_up: Tensor, pdl: bool = False, lora: Delta | None = None) -> Tensor:
    """silu(gate) * up of the fused gate/up output `[tokens, 2 * intermediate]` (lora: its delta, added first)."""
    return _kernel("silu_and_mul", gate_up, pdl)(gate_up, **_delta_kwargs(lora))
