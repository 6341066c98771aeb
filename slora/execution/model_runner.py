"""Owns the pool tensor and the model; turns a scheduled step into one forward (DESIGN §3)."""
import dataclasses
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from slora.adapters.packing import PackedAdapter
from slora.core.scheduler import ScheduledSeq, SchedulerOutput
from slora.execution import step_batch
from slora.execution.attention_backend import TritonAttention, backends_for
from slora.execution.causal_lm import CausalLM
from slora.execution.cuda_graphs import DecodeGraphs, GraphLimits
from slora.execution.device_copy import tensor_on
from slora.execution.lora_backend import LoraLaunchPolicy, TritonLora
from slora.execution.mixed_graphs import MixedGraphs
from slora.execution.pool_memory import PoolMemory, PoolShape
from slora.execution.step_batch import (
    RANK_ALIGN,
    HostBatch,
    LoraTables,
    StepAdapters,
    StepBatch,
    TokenFeed,
    step_max_rank,
)
from slora.kernels.layout import cdiv


class WarmUpStep(NamedTuple):
    """`decodes` one-token sequences, then `seqs` sequences of `tokens_each` tokens, over `slots` adapters."""
    seqs: int
    tokens_each: int
    slots: int
    decodes: int = 0

    @property
    def lengths(self) -> list[int]:
        return [1] * self.decodes + [self.tokens_each] * self.seqs


# Steps that take other compile-time choices in the Triton kernels than the captured decode steps: prefill
# row blocks of 64 (1 x 128) and 32 (4 x 8); under the default LoraLaunchPolicy, the shrink into one h in
# LoRA token blocks of 64 (1 slot, 128 tokens) and 16 (4 x 8, 4 x 40), and split partial sums in blocks of
# 64 (1 slot, 320 tokens) and 16 (5 slots, 80 tokens); and a mixed step, whose decode rows go through the
# decode kernel unsplit. Run once at start so that the first real steps of these kinds do not stall to
# compile: on the H200, compiling in the middle of an offline run cost it seconds (docs/decisions.md).
WARM_UP_STEPS = (WarmUpStep(1, 128, 1), WarmUpStep(4, 8, 4), WarmUpStep(4, 40, 4), WarmUpStep(1, 320, 1),
                 WarmUpStep(5, 16, 5), WarmUpStep(1, 24, 1, decodes=2))


class ModelRunner:
    def __init__(self, model: CausalLM, shape: PoolShape, device: torch.device,
                 graph_limits: GraphLimits | None = None, swap_pages: int = 0, pdl: bool = True,
                 lora_policy: LoraLaunchPolicy = LoraLaunchPolicy()) -> None:
        self.model, self.shape, self.device = model, shape, device
        # On CUDA adapters are copied into the pool on a side stream, and the steps that use them wait by version;
        # tensor-parallel ranks but 0, which know no versions, copy in stream order.
        tp = model.tensor_parallel
        side_copies = device.type == "cuda" and (tp is None or tp.rank == 0)
        self._copy_stream = torch.cuda.Stream(device) if side_copies else None
        self._pending_copies: dict[str, torch.cuda.Event] = {}     # adapter version -> its copy is done
        self._lora_tables = LoraTables()
        # The unified pool: KV pages and adapter pages, page ids shared across layers.
        self.memory = PoolMemory(shape, device, swap_pages)
        self.attention, self.lora = backends_for(device, pdl, lora_policy, model.tensor_parallel)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        if graph_limits is not None and device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.memory.views, self.attention, self.lora, shape.page_size,
                                       graph_limits)
            self.graphs.capture()
            if graph_limits.mixed_tokens > 0:
                assert isinstance(self.attention, TritonAttention), "CUDA runs the Triton attention"
                self.mixed_graphs = MixedGraphs(model, self.memory.views, self.attention, self.lora, shape.page_size,
                                                graph_limits)
                self.mixed_graphs.capture()
            self.warm_up(graph_limits)

    @torch.inference_mode()
    def warm_up(self, limits: GraphLimits) -> None:
        """Run the WARM_UP_STEPS with every adapter module active at rank 0: kernels compile, nothing is
        written to the pool (no token has a KV slot) and no adapter weight is read."""
        for max_rank in sorted({RANK_ALIGN, step_max_rank(limits.max_lora_rank)}):
            for step in self._warm_up_steps(limits):
                self.forward(self._warm_up_inputs(step, limits, max_rank))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_up_steps(self, limits: GraphLimits) -> tuple[WarmUpStep, ...]:
        """WARM_UP_STEPS, the new_kv prefill steps (_new_kv_warm_up_steps), and if the LoRA policy expands
        with the one-token kernel (gemv_expand_min_tokens), a step of a slot per token of its first size and
        of the largest batch (CUDA graphs cover decode steps, but eager steps of one token per adapter launch
        the same kernels)."""
        steps = WARM_UP_STEPS + self._new_kv_warm_up_steps(limits)
        first = self.lora.policy.gemv_expand_min_tokens if isinstance(self.lora, TritonLora) else None
        # A step has at most max_batch sequences and, with max_loras, at most that many adapter slots.
        largest = min(limits.max_batch, limits.max_loras or limits.max_batch)
        if first is None or first > largest:
            return steps
        return steps + tuple(WarmUpStep(n, 1, n) for n in sorted({first, largest}))

    def _new_kv_warm_up_steps(self, limits: GraphLimits) -> tuple[WarmUpStep, ...]:
        """Steps of at least the Triton backend's new_kv_min_tokens prefill tokens, which read their K/V
        through the prefill kernel of their own (smaller steps do not launch it), in both of its row blocks
        (TritonAttention.new_kv_step_shapes)."""
        if not isinstance(self.attention, TritonAttention):
            return ()
        longest = limits.max_blocks * self.shape.page_size
        return tuple(WarmUpStep(seqs, each, 1)
                     for seqs, each in self.attention.new_kv_step_shapes(longest, limits.max_batch))

    def _warm_up_inputs(self, step: WarmUpStep, limits: GraphLimits, max_rank: int) -> HostBatch:
        """The step's sequences over `step.slots` adapters of rank 0 (sequence s on slot s % slots), K/V not
        stored (KV location -1)."""
        lengths = step.lengths
        tokens = sum(lengths)
        sizes = {**limits.sizes(len(lengths), step.slots), "tokens": tokens,
                 "pages": cdiv(max(lengths), self.shape.page_size)}
        batch = step_batch.empty(sizes, torch.device("cpu"), self.shape.page_size, max_rank)
        assert batch.lora is not None
        counts = torch.tensor(lengths)
        starts = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
        seq_of_token = torch.arange(len(lengths)).repeat_interleave(counts)
        return step_batch.as_host(dataclasses.replace(
            batch, positions=torch.cat([torch.arange(n) for n in lengths]), query_start_loc=starts,
            context_lens=counts.to(torch.int32), sample_indices=starts[1:].long() - 1, max_query_len=max(lengths),
            max_context_len=max(lengths), num_decodes=step.decodes,
            lora=dataclasses.replace(batch.lora, token_slots=(seq_of_token % step.slots).to(torch.int32))))

    def set_kv_scales(self, scales: Tensor) -> None:
        """An FP8 cache's scales `[layers, 2, kv_heads]` (slora.kv_scales); graphs captured before read them too."""
        self.memory.set_kv_scales(scales.to(self.device))

    def move_pages(self, out: SchedulerOutput, packed: Mapping[str, PackedAdapter]) -> None:
        """The step's page moves, before its forward (apply_moves), the adapters' from their host copies."""
        self.apply_moves(out, {version: adapter.pages for version, adapter in packed.items()})

    def apply_moves(self, out: SchedulerOutput, host_pages: Mapping[str, Tensor]) -> None:
        """Swap-outs first (their pages may be reused by this very step), then swap-ins, copy-on-write copies
        and adapter loads (`host_pages`: each loaded version's packed pages). Pages of adapters freed since the
        last step may be written from now on, so a copy into them that is still in flight (a prefetched
        adapter evicted before it was used) must end first."""
        self._wait_for_adapters(out.adapters_freed)
        for pages, slots in out.swap_out:
            self.memory.swap_out(self._index(pages), slots)
        for slots, pages in out.swap_in:
            self.memory.swap_in(slots, self._index(pages))
        if out.copies:
            sources, targets = zip(*out.copies)
            self.memory.copy_pages(self._index(sources), self._index(targets))
        for version, pages in out.adapters_to_load:
            self.load_adapter(version, host_pages[version], pages)

    def load_adapter(self, version: str, host_pages: Tensor, pages: list[int]) -> None:
        """Copy an adapter's packed pages `[layers, pages, page_elems]` from the host cache into its pool pages.
        On CUDA the copy runs on a side stream, overlapping the forward; a forward that uses the adapter waits
        for it."""
        if self._copy_stream is None:
            index = torch.tensor(pages, dtype=torch.long, device=self.device)
            self.memory.load_weights(host_pages.to(self.device, self.shape.dtype), index)
            return
        # The pages may have held KV that forwards already queued still read: start after them.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            # The index is allocated on the side stream too: made on the main stream, its memory could be
            # handed to the next step's tensors once this function returns, before the copy has read it.
            index = self._index(pages)
            self.memory.load_weights(host_pages.to(self.device, self.shape.dtype, non_blocking=True), index)
            self._pending_copies[version] = torch.cuda.Event()
            self._pending_copies[version].record()

    def _index(self, pages: Iterable[int]) -> Tensor:
        """Page ids as an index on the pool's device, copied without waiting for the GPU."""
        return tensor_on(list(pages), torch.long, self.device)

    def _wait_for_adapters(self, versions: Iterable[str]) -> None:
        """Make the forward stream wait for the pending copies of these adapter versions."""
        for version in versions:
            event = self._pending_copies.pop(version, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

    def run(self, scheduled: list[ScheduledSeq], adapters: StepAdapters, sampled: Tensor | None = None) -> Tensor:
        """One forward over the scheduled tokens; logits `[sampled, vocab]` of the completing sequences.
        `sampled`: the ids the step before sampled, still on the device, which pending tokens come from."""
        host = self.inputs_for(scheduled, adapters)
        return self.execute(host, len(scheduled), step_batch.token_feed(scheduled, sampled), adapters)

    def execute(self, host: HostBatch, num_seqs: int, feed: TokenFeed | None, versions: Iterable[str] = ()) -> Tensor:
        """One forward of a step built on the host, over `num_seqs` sequences, through a captured graph where
        one fits; `versions`: its adapters, whose copies into the pool it waits for."""
        self._wait_for_adapters(versions)
        bucket = self._graph_bucket(num_seqs, host)
        if bucket is not None:
            assert self.graphs is not None
            return self.graphs.replay(bucket, host, num_seqs, feed)
        if self.mixed_graphs is not None and host.max_query_len > 1:
            bucket = self.mixed_graphs.fits(host, num_seqs)
            if bucket is not None:
                return self.mixed_graphs.replay(bucket, host, feed)
        return self.forward(host, feed)

    def inputs_for(self, scheduled: list[ScheduledSeq], adapters: StepAdapters) -> HostBatch:
        """A step's inputs on the host (adapter tables of recent mixes come from a cache)."""
        return step_batch.build(scheduled, adapters, self.shape.page_size, self._lora_tables)

    def forward(self, host: HostBatch, feed: TokenFeed | None = None) -> Tensor:
        """An eager forward of a step built on the host (its pending input ids fed on the device)."""
        batch = host.to(self.device)
        step_batch.feed_tokens(batch, feed)
        lora = None if batch.lora is None else self.lora.step(batch.lora)
        return self.model(batch, self.memory.views, self.attention, lora)

    # ---- CUDA graphs --------------------------------------------------------------------------------
    def _graph_bucket(self, num_seqs: int, host: HostBatch) -> int | None:
        if self.graphs is None or host.max_query_len != 1 or len(host.sample_indices) != num_seqs:
            return None
        return self.graphs.fits(host, num_seqs)


@torch.inference_mode()
def prompts_batch(prompts: list[np.ndarray], page_size: int) -> HostBatch:
    """A prefill of whole prompts (int64 token ids each), the pages of each after the last's, from page 0."""
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    pages = -(-lengths // page_size)
    first_page = np.concatenate([[0], np.cumsum(pages)[:-1]])
    width = int(pages.max())
    tables = (first_page[:, None] + np.arange(width)[None, :]).astype(np.int32)          # [seqs, width]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths])
    seq_of_token = np.repeat(np.arange(len(prompts)), lengths)
    locations = (first_page[seq_of_token] * page_size + positions).astype(np.int64)
    return StepBatch(input_ids=np.concatenate(prompts).astype(np.int64), positions=positions, kv_locations=locations,
                     block_tables=tables, query_start_loc=starts, context_lens=lengths.astype(np.int32),
                     sample_indices=(starts[1:] - 1).astype(np.int64), page_size=page_size,
                     max_query_len=int(lengths.max()), max_context_len=int(lengths.max()))


def profile_activation_bytes(model: CausalLM, shape: PoolShape, num_tokens: int, device: torch.device) -> int:
    """Peak CUDA memory of one prefill of `num_tokens` tokens beyond the weights and its own KV pages."""
    runner = ModelRunner(model, shape.with_pages(-(-num_tokens // shape.page_size)), device)
    host = prompts_batch([np.zeros(num_tokens, dtype=np.int64)], shape.page_size)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.forward(host)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
