"""Tensor parallelism on the device side (DESIGN §10): a rank's place in the group and the collectives its
forward runs.

Megatron's split: each rank holds some attention heads and some MLP columns, so the row-parallel projections
(o_proj, down_proj) give partial sums, added up by one all-reduce each. The LoRA follows one of two schemes:

- replicated (vLLM's default): on column-parallel modules every rank holds the whole A and its outputs' part
  of B; on row-parallel ones its inputs' part of A and the whole B. Each rank's partial delta rides in the
  base all-reduce, and nothing else is sent.
- fully sharded (S-LoRA's): column-parallel A is split by rank (rank j holds rows j, j + N, ...), the
  `[tokens, r / N]` shrinks are all-gathered into `[tokens, r]` before the expand; row-parallel A is split by
  input, its `[tokens, r]` shrink all-reduced, and B split by output, so each rank writes its own columns of
  the delta into the partial sum that the base all-reduce adds up.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

# The collectives' names in a profile (benchmarks/tensor_parallel.py sums them).
BASE_ALL_REDUCE, LORA_ALL_REDUCE, LORA_ALL_GATHER = "tp.base_all_reduce", "tp.lora_all_reduce", "tp.lora_all_gather"
# torch 2.13 renamed all_gather_into_tensor (and warns at each call of the old name).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank ended or stopped answering: the engine cannot go on."""


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size`, its LoRA scheme, and the process group the collectives run in (the default
    group when None)."""
    rank: int
    size: int
    fully_sharded_loras: bool = False
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: Tensor) -> Tensor:
        """The row-parallel projections' partial sums `[tokens, hidden]` summed over the ranks, in place."""
        with record_function(BASE_ALL_REDUCE):
            dist.all_reduce(x, group=self.group)
        return x

    def reduce_lora(self, h: Tensor) -> Tensor:
        """Fully sharded row LoRA: the ranks' partial shrinks `[tokens, modules * r]` summed, in place."""
        with record_function(LORA_ALL_REDUCE):
            dist.all_reduce(h, group=self.group)
        return h

    def gather_rank_split(self, h: Tensor, modules: int) -> Tensor:
        """Fully sharded column LoRA: each rank's shrink `[tokens, modules * m]` (rank j's column i is column
        i * size + j of the whole) as the whole `[tokens, modules * m * size]`."""
        tokens, width = h.shape
        gathered = h.new_empty(self.size * tokens, width)                      # the ranks' h, one after another
        with record_function(LORA_ALL_GATHER):
            _ALL_GATHER(gathered, h.contiguous(), group=self.group)
        per_module = gathered.view(self.size, tokens, modules, width // modules)
        return per_module.permute(1, 2, 3, 0).reshape(tokens, width * self.size)

    def slowest(self, seconds: list[float], device: torch.device) -> list[float]:
        """Each of a list of timings as the slowest rank measured it: choices made from timings (which graphs
        to replay) must be the same on every rank, whose collectives must match."""
        times = torch.tensor(seconds, dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.group)
        return times.tolist()

    def own_columns(self, out: Tensor) -> Tensor:
        """Fully sharded row LoRA: this rank's equal share of out's `[tokens, features]` columns (a view)."""
        return out.chunk(self.size, dim=1)[self.rank]

