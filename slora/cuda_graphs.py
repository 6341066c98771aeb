"""Decode steps captured in CUDA graphs, one per bucketed batch size (and with / without LoRA).

Every per-step input lives in a preallocated device buffer that the graphs read, so a replay with other
sequences, other block tables and another adapter mix is correct: block tables, slots, context lengths,
per-token adapter slots, adapter page tables, ranks, offsets and scalings are all copied in before the
replay. Padding rows have slot -1 (their K/V are not stored) and context length 0 (attention gives 0).
"""
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from slora.forward_batch import ForwardBatch, LoraBatch
from slora.kernels.layout import LORA_MODULES

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, and max_batch itself: every batch up to max_batch has a bucket."""
    candidates = [1, 2, 4, 8, *range(16, max_batch, 16), max_batch]
    return sorted({b for b in candidates if b <= max_batch})


@dataclass(frozen=True)
class GraphLimits:
    max_batch: int
    max_blocks: int            # block-table width: pages of the longest sequence
    max_adapter_pages: int     # page-table width: pages of the largest adapter
    max_lora_rank: int
    num_layers: int
    max_loras: int | None = None   # distinct adapters per batch; the LoRA kernels' grids are sized by it
    # Decode steps with at most this many distinct adapters replay graphs captured for that many adapter
    # slots: the LoRA grids have a spare block per slot, so fewer slots launch fewer idle programs (0: none).
    few_adapters: int = 0
    lora_fused: bool = False       # the few-adapter graphs run lora_fused (one launch per group)
    # Each group's LoRA runs on a second stream while its base GEMM runs, as a delta that the op reading the
    # projection adds (LoraBatch.deltas); not in graphs that run lora_fused, which adds in place.
    lora_side_stream: bool = True

    def lora_slots(self, batch_size: int, few: bool = False) -> int:
        """Adapter slots a bucket's graph is captured for: fewer slots, fewer programs per LoRA launch."""
        slots = batch_size if self.max_loras is None else min(batch_size, self.max_loras)
        return min(slots, self.few_adapters) if few else slots

    def lora_deltas(self, few: bool) -> bool:
        """Whether a graph's LoRA runs on the side stream as deltas."""
        return self.lora_side_stream and not (few and self.lora_fused)

    def graph_kinds(self, batch_size: int) -> list[tuple[bool, bool]]:
        """(with LoRA, few adapters) of the graphs captured for a bucket: a few-adapter graph only where it
        has fewer slots than the full one (or runs other kernels)."""
        few = self.few_adapters > 0 and (self.lora_fused or self.lora_slots(batch_size, True) <
                                         self.lora_slots(batch_size))
        return [(False, False), (True, False)] + ([(True, True)] if few else [])


class StaticInputs:
    """The device buffers every captured graph reads; sized for the largest bucket."""

    def __init__(self, limits: GraphLimits, device: torch.device) -> None:
        b, modules = limits.max_batch, len(LORA_MODULES)
        zeros = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype, device=device)
        self.input_ids, self.positions = zeros(b, dtype=torch.long), zeros(b, dtype=torch.long)
        self.slot_mapping = zeros(b, dtype=torch.long) - 1
        self.block_tables, self.context_lens = zeros(b, limits.max_blocks), zeros(b)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.sample_indices = torch.arange(b, dtype=torch.long, device=device)
        self.token_slots = zeros(b) - 1
        self.page_tables = zeros(b, limits.max_adapter_pages)
        self.ranks = zeros(limits.num_layers, modules, b)
        self.a_offsets = zeros(limits.num_layers, modules, b, dtype=torch.long)
        self.b_offsets = zeros(limits.num_layers, modules, b, dtype=torch.long)
        self.scalings = zeros(limits.num_layers, modules, b, dtype=torch.float32)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, pool: Tensor, attention: object, lora_ops: object,
                 page_size: int, limits: GraphLimits) -> None:
        self.model, self.pool, self.attention, self.lora_ops = model, pool, attention, lora_ops
        self.page_size, self.limits = page_size, limits
        self.static = StaticInputs(limits, pool.device)
        self.buckets = batch_buckets(limits.max_batch)
        self.graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.side_stream = torch.cuda.Stream(pool.device) if limits.lora_side_stream else None

    def batch(self, size: int, with_lora: bool, few: bool = False) -> ForwardBatch:
        """The ForwardBatch of a bucket, as views of the static buffers."""
        s = self.static
        lora = None
        if with_lora:
            slots, deltas = self.limits.lora_slots(size, few), self.limits.lora_deltas(few)
            lora = LoraBatch(token_slots=s.token_slots[:size], page_tables=s.page_tables[:slots],
                             ranks=s.ranks[:, :, :slots], a_offsets=s.a_offsets[:, :, :slots],
                             b_offsets=s.b_offsets[:, :, :slots], scalings=s.scalings[:, :, :slots],
                             max_rank=self.limits.max_lora_rank,
                             ops=self.lora_ops.prepare(s.token_slots[:size], slots, self.limits.num_layers,
                                                       few and self.limits.lora_fused),
                             active=[[True] * len(LORA_MODULES)] * self.limits.num_layers,
                             deltas=deltas, side_stream=self.side_stream if deltas else None)
        return ForwardBatch(s.input_ids[:size], s.positions[:size], s.slot_mapping[:size], s.block_tables[:size],
                            s.query_start_loc[:size + 1], s.context_lens[:size], s.sample_indices[:size],
                            self.page_size, 1, self.limits.max_blocks * self.page_size, lora)

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        mempool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            for with_lora, few in self.limits.graph_kinds(size):
                self._forward(size, with_lora, few)      # warm-up: compiles kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool):
                    logits = self._forward(size, with_lora, few)
                self.graphs[(size, with_lora, few)] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs for batch sizes %s", len(self.graphs), self.buckets)

    def _forward(self, size: int, with_lora: bool, few: bool) -> Tensor:
        return self.model(self.batch(size, with_lora, few), self.pool, self.attention)

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def uses_few(self, size: int, num_adapters: int) -> bool:
        """Whether a decode step of this bucket with this many distinct adapters replays a few-adapter graph."""
        return 0 < num_adapters <= self.limits.lora_slots(size, few=True) and (size, True, True) in self.graphs

    def replay(self, size: int, with_lora: bool, batch_size: int, few: bool = False) -> Tensor:
        graph, logits = self.graphs[(size, with_lora, few)]
        graph.replay()
        return logits[:batch_size]
