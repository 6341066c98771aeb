"""Rotary position embeddings, with the `linear` and `llama3` frequency scalings."""
import math

import torch
from torch import Tensor

from slora.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> Tensor:
    """[head_dim // 2] float32 inverse frequencies after the configured scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    inv_freq: Tensor                 # [head_dim / 2], the buffer registered in __init__

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin `[tokens, head_dim]` for the given positions."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]   # [tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
