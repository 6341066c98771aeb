"""Decode steps captured in CUDA graphs, one per bucketed batch size (and with / without LoRA).

Every per-step input lives in a preallocated device buffer that the graphs read (a `StepBatch` of the
largest size), so a replay with other sequences, other block tables and another adapter mix is correct:
a step's `StepBatch` is written into a host twin of the buffers and sent in one copy before the replay
(slora.execution.staging). Padding rows have KV location -1 (their K/V are not
stored) and context length 0 (attention gives 0); adapter slots past the step's have rank 0.
"""
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from slora.execution import step_batch
from slora.execution.attention_backend import AttentionBackend
from slora.execution.causal_lm import CausalLM
from slora.execution.lora_backend import LoraBackend, LoraStep
from slora.execution.pool_memory import PoolViews
from slora.execution.staging import BatchViews, StagedBatch
from slora.execution.step_batch import HostBatch, StepBatch, TokenFeed

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
    num_lora_modules: int      # the model's lora_modules
    max_loras: int | None = None   # distinct adapters per batch; the LoRA kernels' grids are sized by it
    # Decode steps with at most this many distinct adapters replay graphs captured for that many adapter
    # slots: the LoRA grids have a spare block per slot, so fewer slots launch fewer idle programs (0: none).
    few_adapters: int = 0
    # Each group's LoRA runs on a second stream while its base GEMM runs, as a delta that the op reading the
    # projection adds (LoraStep.deltas).
    lora_side_stream: bool = True
    # Steps with prefill rows of at most this many tokens replay graphs of their token bucket
    # (slora.execution.mixed_graphs; 0: none).
    mixed_tokens: int = 0

    def adapter_slots(self, batch_size: int, few: bool = False) -> int:
        """Adapter slots a bucket's graph is captured for: fewer slots, fewer programs per LoRA launch."""
        slots = batch_size if self.max_loras is None else min(batch_size, self.max_loras)
        return min(slots, self.few_adapters) if few else slots

    def graph_kinds(self, batch_size: int) -> list[tuple[bool, bool]]:
        """(with LoRA, few adapters) of the graphs captured for a bucket: a few-adapter graph only where it
        has fewer slots than the full one."""
        few = self.few_adapters > 0 and self.adapter_slots(batch_size, True) < self.adapter_slots(batch_size)
        return [(False, False), (True, False)] + ([(True, True)] if few else [])

    def holds(self, host: HostBatch, slots: int) -> bool:
        """Whether a step's block table and adapter tables fit static buffers of these limits with `slots`
        adapter slots (more adapters than that cannot happen under max_loras, but a graph must never be
        replayed for a step it does not fit)."""
        if host.block_tables.shape[1] > self.max_blocks:
            return False
        lora = host.lora
        return lora is None or (lora.page_tables.shape[0] <= slots
                                and lora.page_tables.shape[1] <= self.max_adapter_pages)   # [slots, pages]

    def sizes(self, batch_size: int, slots: int) -> dict[str, int]:
        """The StepBatch sizes of a decode graph: one token per sequence."""
        return {"tokens": batch_size, "seqs": batch_size, "pages": self.max_blocks, "slots": slots,
                "adapter_pages": self.max_adapter_pages, "layers": self.num_layers,
                "modules": self.num_lora_modules}


class DecodeGraphs:
    def __init__(self, model: CausalLM, pool: PoolViews, attention: AttentionBackend, lora: LoraBackend,
                 page_size: int, limits: GraphLimits) -> None:
        self.model, self.pool, self.attention, self.lora = model, pool, attention, lora
        self.limits = limits
        largest = limits.sizes(limits.max_batch, limits.adapter_slots(limits.max_batch))
        self.staged = StagedBatch(step_batch.empty(largest, torch.device("cpu"), page_size, limits.max_lora_rank),
                                  pool.weights[0].device)
        self.buckets = batch_buckets(limits.max_batch)
        # (batch size, with LoRA, few adapters) -> (graph, its inputs, its logits)
        self.graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, BatchViews, Tensor]] = {}
        self.side_stream = torch.cuda.Stream(pool.weights[0].device) if limits.lora_side_stream else None

    def batch(self, size: int, with_lora: bool, few: bool = False) -> BatchViews:
        """The StepBatch of a bucket, as views of the static buffers and of their host twins."""
        sizes = self.limits.sizes(size, self.limits.adapter_slots(size, few))
        return self.staged.views(sizes, with_lora)

    def _lora_step(self, batch: StepBatch[Tensor]) -> LoraStep | None:
        if batch.lora is None:
            return None
        return self.lora.step(batch.lora, deltas=self.limits.lora_side_stream, side_stream=self.side_stream)

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        mempool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            for with_lora, few in self.limits.graph_kinds(size):
                views = self.batch(size, with_lora, few)
                self._forward(views.device)              # warm-up: compiles kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool):
                    logits = self._forward(views.device)
                self.graphs[(size, with_lora, few)] = (graph, views, logits)
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs for batch sizes %s", len(self.graphs), self.buckets)

    def _forward(self, batch: StepBatch[Tensor]) -> Tensor:
        return self.model(batch, self.pool, self.attention, self._lora_step(batch))

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def fits(self, host: HostBatch, batch_size: int) -> int | None:
        """The bucket of a decode step of `batch_size` sequences whose tables fit its static buffers, or None."""
        bucket = self.bucket_for(batch_size)
        return bucket if bucket is not None and self.limits.holds(host, self.limits.adapter_slots(bucket)) else None

    def uses_few(self, size: int, num_adapters: int) -> bool:
        """Whether a decode step of this bucket with this many distinct adapters replays a few-adapter graph."""
        return 0 < num_adapters <= self.limits.adapter_slots(size, few=True) and (size, True, True) in self.graphs

    def replay(self, size: int, host: HostBatch, batch_size: int, feed: TokenFeed | None = None) -> Tensor:
        """Copy a decode step of `batch_size` sequences (and its input ids still on the device) into the
        bucket's graph and replay it."""
        num_adapters = 0 if host.lora is None else host.lora.page_tables.shape[0]
        graph, views, logits = self.graphs[(size, host.lora is not None, self.uses_few(size, num_adapters))]
        host.copy_into(self.staged.begin(views).batch)
        self.staged.send()
        step_batch.feed_tokens(views.device, feed)
        graph.replay()
        return logits[:batch_size]
