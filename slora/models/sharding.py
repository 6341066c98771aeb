"""One tensor-parallel rank's part of a Llama-family checkpoint (Megatron's split, DESIGN §10).

Column-parallel projections (q, k, v, gate, up) keep the output rows of the rank's heads or MLP columns;
row-parallel ones (o, down) keep the matching input columns, and their bias stays on rank 0 alone, since the
ranks' partial products are summed. Embeddings, norms and lm_head are whole on every rank.
"""
import re
from typing import NamedTuple

import torch

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
_PROJECTION = re.compile(r"model\.layers\.\d+\.(?:self_attn|mlp)\.(?P<module>\w+)\.(?P<kind>weight|bias)")


class Shard(NamedTuple):
    """Rank `rank` of `size` tensor-parallel ranks."""
    rank: int
    size: int

    def part(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal contiguous share of `tensor` along `dim` (a copy, so the whole can be freed)."""
        return tensor.chunk(self.size, dim)[self.rank].clone()


def shard_state(state: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """The state dict of the rank's part of the model, from the whole model's (Hugging Face names)."""
    return {name: _shard_tensor(name, tensor, shard) for name, tensor in state.items()}


def _shard_tensor(name: str, tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    match = _PROJECTION.fullmatch(name)
    if match is None or shard.size == 1:
        return tensor
    module, kind = match["module"], match["kind"]
    if module in COLUMN_PARALLEL:
        return shard.part(tensor, 0)                    # weight [out, in] and bias [out]: the rank's outputs
    if module not in ROW_PARALLEL:
        return tensor
    if kind == "weight":
        return shard.part(tensor, 1)                    # [out, in / size]: the rank's inputs
    return tensor if shard.rank == 0 else torch.zeros_like(tensor)    # added once to the summed output
