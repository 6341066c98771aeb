"""One tensor-parallel rank's part of an adapter (DESIGN §10), in the two schemes the engine offers.

Column-parallel modules (their outputs split over the ranks): B keeps the rank's output rows; A stays whole
(replicated), or, fully sharded, keeps every size-th rank from the rank's own (its rank padded with zero rows
to a multiple of the size, which changes no product). Row-parallel modules (their inputs split): A keeps the
rank's input columns; B stays whole (replicated), or keeps the rank's output rows (fully sharded).
"""
import dataclasses
from typing import NamedTuple

import torch

from slora.adapters.shapes import TargetShapes
from slora.adapters.weights import LoadedAdapter, LoraWeights


class AdapterSharding(NamedTuple):
    """How a tensor-parallel engine splits adapters: over `size` ranks, fully sharded or with replicated A;
    `row_parallel`: the modules whose inputs are split (the rest have their outputs split); `shapes`: the
    layout of one rank's part of the model, which every rank's part of an adapter is packed to."""
    size: int
    fully_sharded: bool
    row_parallel: frozenset[str]
    shapes: TargetShapes


def shard_adapter(adapter: LoadedAdapter, rank: int, sharding: AdapterSharding) -> LoadedAdapter:
    """Rank `rank`'s part of a whole (validated) adapter."""
    weights = {key: _shard_module(lora, rank, sharding, key[1] in sharding.row_parallel)
               for key, lora in adapter.weights.items()}
    return dataclasses.replace(adapter, weights=weights)


def _shard_module(lora: LoraWeights, rank: int, sharding: AdapterSharding, row_parallel: bool) -> LoraWeights:
    size = sharding.size
    lora_a, lora_b = lora.lora_a, lora.lora_b                    # [r, in], [out, r]
    if row_parallel:
        lora_a = lora_a.chunk(size, dim=1)[rank]                 # [r, in / size]
        if sharding.fully_sharded:
            lora_b = lora_b.chunk(size, dim=0)[rank]             # [out / size, r]
    else:
        lora_b = lora_b.chunk(size, dim=0)[rank]                 # [out / size, r]
        if sharding.fully_sharded:
            lora_a, lora_b = _padded_rank(lora_a, lora_b, size)
            lora_a = lora_a[rank::size]                          # [r / size, in]: ranks rank, rank + size, ...
    return LoraWeights(lora_a.contiguous(), lora_b.contiguous(), lora.scaling)


def _padded_rank(lora_a: torch.Tensor, lora_b: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B with zero ranks added up to a multiple of `size` (the product is unchanged)."""
    pad = -lora_a.shape[0] % size
    if not pad:
        return lora_a, lora_b
    return (torch.cat([lora_a, lora_a.new_zeros(pad, lora_a.shape[1])]),
            torch.cat([lora_b, lora_b.new_zeros(lora_b.shape[0], pad)], dim=1))
