"""Owns the pool tensor and the model; turns a scheduled step into one forward (DESIGN §3)."""
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from slora.adapters.packing import AdapterDescriptor, PackedAdapter
from slora.attention_backend import LoraLaunchPolicy, backends_for
from slora.cuda_graphs import DecodeGraphs, GraphLimits
from slora.forward_batch import ForwardBatch, LoraBatch
from slora.kernels.layout import LORA_MODULES, align_up, cdiv
from slora.models.llama import LlamaForCausalLM
from slora.scheduler import ScheduledSeq, SchedulerOutput

# version -> (where its weights lie in its buffer, its pages in the pool)
StepAdapters = dict[str, tuple[AdapterDescriptor, list[int]]]

# Steps that take other compile-time choices in the Triton kernels than the captured decode steps, as
# (sequences, tokens each, adapter slots): prefill row blocks of 64 (1 x 128) and 32 (4 x 8); under the
# default LoraLaunchPolicy, the shrink into one h in LoRA token blocks of 64 (1 slot, 128 tokens) and 16
# (4 x 8, 4 x 40), and split partial sums in blocks of 64 (1 slot, 320 tokens) and 16 (5 slots, 80
# tokens). Run once at start so that the first real steps of these kinds do not stall to compile: on
# the H200, compiling in the middle of an offline run cost it seconds (benchmarks/README.md).
WARM_UP_STEPS = ((1, 128, 1), (4, 8, 4), (4, 40, 4), (1, 320, 1), (5, 16, 5))
# Step max ranks are multiples of this (step_max_rank); the warm-up runs one of them (one rank block) and
# the engine's largest.
RANK_ALIGN = 16


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def page_elems(self) -> int:
        return 2 * self.page_size * self.num_kv_heads * self.head_dim


@dataclass
class HostLora:
    """The step's adapter table on the host; slot s is the s-th distinct version of the step."""

    token_slots: Tensor     # [tokens] int32
    page_tables: Tensor     # [slots, max_pages] int32
    ranks: Tensor           # [layers, modules, slots] int32
    a_offsets: Tensor       # [layers, modules, slots] int64
    b_offsets: Tensor
    scalings: Tensor        # float32
    max_rank: int
    active: list[list[bool]]   # [layer][module]: whether any adapter of the step targets it


@dataclass
class HostInputs:
    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    query_start_loc: Tensor
    context_lens: Tensor
    sample_indices: Tensor
    max_query_len: int
    max_context_len: int
    lora: HostLora | None


def host_inputs(scheduled: list[ScheduledSeq], adapters: StepAdapters, page_size: int,
                lora_tables: "LoraTables | None" = None) -> HostInputs:
    """The flat batch of a step, built on the host."""
    input_ids, positions, slots, starts, lens, sample_rows = [], [], [], [0], [], []
    for item in scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_tokens
        input_ids += seq.tokens_between(start, end)
        positions += range(start, end)
        slots += [seq.block_table[i // page_size] * page_size + i % page_size for i in range(start, end)]
        starts.append(starts[-1] + item.num_tokens)
        lens.append(end)
        if item.completes:
            sample_rows.append(starts[-1] - 1)
    return HostInputs(
        int_tensor(input_ids, np.int64), int_tensor(positions, np.int64), int_tensor(slots, np.int64),
        padded_rows([i.seq.block_table for i in scheduled]), int_tensor(starts, np.int32),
        int_tensor(lens, np.int32), int_tensor(sample_rows, np.int64), max(i.num_tokens for i in scheduled),
        max(lens), host_lora(scheduled, adapters, lora_tables or LoraTables()))


def int_tensor(values: list[int], dtype: type[np.integer]) -> Tensor:
    """A 1-D int tensor from a list. Through numpy, which converts a list of ints two to three times
    faster than torch.tensor (a step builds several on the host: 8.2 against 2.9 µs for 64 ints here)."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def padded_rows(rows: list[list[int]]) -> Tensor:
    """A list of int lists as one zero-padded int32 matrix (one tensor construction, not one per row)."""
    width = max(len(r) for r in rows)
    flat: list[int] = []
    for row in rows:
        flat += row
        flat += [0] * (width - len(row))
    return torch.from_numpy(np.array(flat, dtype=np.int32).reshape(len(rows), width))


class LoraTables:
    """The per-step adapter tables `[layers, modules, slots]` of recent adapter mixes. Decode steps
    usually repeat the previous step's mix, and stacking every version's descriptor again each step
    costs more host time than the rest of the step's LoRA inputs."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._tables: dict[tuple[str, ...], "AdapterTables"] = {}

    def get(self, versions: tuple[str, ...], adapters: StepAdapters) -> "AdapterTables":
        """The tables of the versions in slot order, and what follows from them alone."""
        tables = self._tables.pop(versions, None) or self._stack(versions, adapters)
        self._tables[versions] = tables                      # most recent last
        if len(self._tables) > self.capacity:
            del self._tables[next(iter(self._tables))]
        return tables

    @staticmethod
    def _stack(versions: tuple[str, ...], adapters: StepAdapters) -> "AdapterTables":
        descriptors = [adapters[v][0] for v in versions]
        stack = lambda name: torch.stack([getattr(d, name) for d in descriptors], dim=-1)
        ranks = stack("ranks")                                                    # [layers, modules, slots]
        return AdapterTables(ranks, stack("a_offsets"), stack("b_offsets"), stack("scalings"),
                             step_max_rank(int(ranks.max())), (ranks.amax(dim=-1) > 0).tolist())


def step_max_rank(highest_rank: int) -> int:
    """The LoRA kernels' max_rank for a step whose highest adapter rank is `highest_rank`: rounded up to a
    multiple of RANK_ALIGN. Triton specialises integer arguments on divisibility by 16, and max_rank sets
    several (h's width and strides), so rank 8 and rank 16 steps would otherwise compile different kernel
    variants, each in the middle of serving. Columns past an adapter's rank are never read."""
    return align_up(highest_rank, RANK_ALIGN)


class AdapterTables(NamedTuple):
    ranks: Tensor
    a_offsets: Tensor
    b_offsets: Tensor
    scalings: Tensor
    max_rank: int
    active: list[list[bool]]


def host_lora(scheduled: list[ScheduledSeq], adapters: StepAdapters, tables: LoraTables) -> HostLora | None:
    versions = tuple(sorted(adapters))         # the step's adapter versions, one slot each
    if not versions:
        return None
    slot_of = {v: i for i, v in enumerate(versions)}
    token_slots = [slot_of[item.seq.adapter.version] if item.seq.adapter else -1
                   for item in scheduled for _ in range(item.num_tokens)]
    return HostLora(int_tensor(token_slots, np.int32), padded_rows([adapters[v][1] for v in versions]),
                    *tables.get(versions, adapters))


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, shape: PoolShape, dtype: torch.dtype, device: torch.device,
                 graph_limits: GraphLimits | None = None, swap_pages: int = 0, pdl: bool = True,
                 lora_policy: LoraLaunchPolicy = LoraLaunchPolicy()) -> None:
        self.model, self.shape, self.device = model, shape, device
        self.swap_pages, self._swap = swap_pages, None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending_copies: dict[str, torch.cuda.Event] = {}     # adapter version -> its copy is done
        self._lora_tables = LoraTables()
        # The unified pool: KV pages and adapter pages, page ids shared across layers.
        self.pool = torch.zeros(shape.num_layers, shape.num_pages, shape.page_elems, dtype=dtype,
                                device=device)  # [layers, pages, page_elems]
        self.attention, self.lora_ops = backends_for(device, pdl, lora_policy)
        self.graphs: DecodeGraphs | None = None
        if graph_limits is not None and device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.pool, self.attention, self.lora_ops, shape.page_size,
                                       graph_limits)
            self.graphs.capture()
            self.warm_up(graph_limits)

    @torch.inference_mode()
    def warm_up(self, limits: GraphLimits) -> None:
        """Run the WARM_UP_STEPS with every adapter module active at rank 0: kernels compile, nothing is
        written to the pool (no token has a KV slot) and no adapter weight is read."""
        for max_rank in sorted({RANK_ALIGN, step_max_rank(limits.max_lora_rank)}):
            for num_seqs, tokens_each, slots in self._warm_up_steps(limits):
                host = self._warm_up_inputs(num_seqs, tokens_each, slots, limits, max_rank)
                self.model(self.to_device(host), self.pool, self.attention)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_up_steps(self, limits: GraphLimits) -> tuple[tuple[int, int, int], ...]:
        """WARM_UP_STEPS, and if the LoRA policy expands with the one-token kernel (gemv_expand_min_tokens), a
        step of a slot per token of its first size and of the largest batch (CUDA graphs cover decode steps,
        but eager steps of one token per adapter launch the same kernels)."""
        first = getattr(getattr(self.lora_ops, "policy", None), "gemv_expand_min_tokens", None)
        # A step has at most max_batch sequences and, with max_loras, at most that many adapter slots.
        largest = min(limits.max_batch, limits.max_loras or limits.max_batch)
        if first is None or first > largest:
            return WARM_UP_STEPS
        return WARM_UP_STEPS + tuple((n, 1, n) for n in sorted({first, largest}))

    def _warm_up_inputs(self, num_seqs: int, tokens_each: int, slots: int, limits: GraphLimits,
                        max_rank: int) -> HostInputs:
        """A prefill of num_seqs sequences of tokens_each tokens over `slots` adapters of rank 0."""
        tokens = num_seqs * tokens_each
        tables = (limits.num_layers, len(LORA_MODULES), slots)
        lora = HostLora(torch.arange(tokens, dtype=torch.int32) // tokens_each % slots,
                        torch.zeros(slots, limits.max_adapter_pages, dtype=torch.int32),
                        torch.zeros(tables, dtype=torch.int32), torch.zeros(tables, dtype=torch.long),
                        torch.zeros(tables, dtype=torch.long), torch.zeros(tables), max_rank,
                        [[True] * len(LORA_MODULES)] * limits.num_layers)
        starts = torch.arange(0, tokens + 1, tokens_each, dtype=torch.int32)
        return HostInputs(torch.zeros(tokens, dtype=torch.long), torch.arange(tokens_each).repeat(num_seqs),
                          torch.full((tokens,), -1),                                    # slot -1: K/V not stored
                          torch.zeros(num_seqs, cdiv(tokens_each, self.shape.page_size), dtype=torch.int32),
                          starts, torch.full((num_seqs,), tokens_each, dtype=torch.int32),
                          starts[1:].long() - 1, tokens_each, tokens_each, lora)

    def move_pages(self, out: SchedulerOutput, packed: dict[str, PackedAdapter]) -> None:
        """The step's page moves, before its forward: swap-outs first (their pages may be reused by
        this very step), then swap-ins, copy-on-write copies and adapter loads. Pages of adapters
        freed since the last step may be written from now on, so a copy into them that is still in
        flight (a prefetched adapter evicted before it was used) must end first."""
        self._wait_for_adapters(out.adapters_freed)
        for pages, slots in out.swap_out:
            self.swap_space()[:, slots] = self.pool[:, pages].to("cpu", non_blocking=False)
        for slots, pages in out.swap_in:
            self.pool[:, pages] = self.swap_space()[:, slots].to(self.device, non_blocking=True)
        if out.copies:
            sources, targets = zip(*out.copies)
            self.pool[:, list(targets)] = self.pool[:, list(sources)]
        for version, pages in out.adapters_to_load:
            self.load_adapter(packed[version], pages)

    def swap_space(self) -> Tensor:
        """Host pages for swapped-out KV `[layers, swap_pages, page_elems]`, made on first use."""
        if self._swap is None:
            shape = (self.shape.num_layers, self.swap_pages, self.shape.page_elems)
            self._swap = torch.empty(shape, dtype=self.pool.dtype, pin_memory=self.device.type == "cuda")
        return self._swap

    def load_adapter(self, packed: PackedAdapter, pages: list[int]) -> None:
        """Copy an adapter's packed pages from the host cache into its pool pages. On CUDA the copy runs
        on a side stream, overlapping the forward; a forward that uses the adapter waits for it."""
        if self._copy_stream is None:
            index = torch.tensor(pages, dtype=torch.long, device=self.device)
            self.pool.index_copy_(1, index, packed.pages.to(self.device, self.pool.dtype))
            return
        # The pages may have held KV that forwards already queued still read: start after them.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            # The index is allocated on the side stream too: made on the main stream, its memory could be
            # handed to the next step's tensors once this function returns, before the copy has read it.
            index = torch.tensor(pages, dtype=torch.long, device=self.device)
            self.pool.index_copy_(1, index, packed.pages.to(self.device, self.pool.dtype, non_blocking=True))
            self._pending_copies[packed.version] = torch.cuda.Event()
            self._pending_copies[packed.version].record()

    def _wait_for_adapters(self, versions: Iterable[str]) -> None:
        """Make the forward stream wait for the pending copies of these adapter versions."""
        for version in versions:
            event = self._pending_copies.pop(version, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

    def run(self, scheduled: list[ScheduledSeq], adapters: StepAdapters) -> Tensor:
        """One forward over the scheduled tokens; logits `[sampled, vocab]` of the completing sequences."""
        host = self.inputs_for(scheduled, adapters)
        self._wait_for_adapters(adapters)
        bucket = self._graph_bucket(scheduled, host)
        if bucket is not None:
            return self._replay(bucket, host, len(scheduled))
        return self.model(self.to_device(host), self.pool, self.attention)

    def inputs_for(self, scheduled: list[ScheduledSeq], adapters: StepAdapters) -> HostInputs:
        """A step's inputs on the host (adapter tables of recent mixes come from a cache)."""
        return host_inputs(scheduled, adapters, self.shape.page_size, self._lora_tables)

    def to_device(self, host: HostInputs) -> ForwardBatch:
        move = lambda t: t.to(self.device, non_blocking=True)
        return ForwardBatch(move(host.input_ids), move(host.positions), move(host.slot_mapping),
                            move(host.block_tables), move(host.query_start_loc), move(host.context_lens),
                            move(host.sample_indices), self.shape.page_size, host.max_query_len,
                            host.max_context_len, self._lora_batch(host.lora))

    def _lora_batch(self, lora: HostLora | None) -> LoraBatch | None:
        if lora is None:
            return None
        move = lambda t: t.to(self.device, non_blocking=True)
        token_slots = move(lora.token_slots)
        return LoraBatch(token_slots=token_slots, page_tables=move(lora.page_tables), ranks=move(lora.ranks),
                         a_offsets=move(lora.a_offsets), b_offsets=move(lora.b_offsets),
                         scalings=move(lora.scalings), max_rank=lora.max_rank,
                         ops=self.lora_ops.prepare(token_slots, lora.page_tables.shape[0], lora.ranks.shape[0]),
                         active=lora.active)

    # ---- CUDA graphs --------------------------------------------------------------------------------
    def _graph_bucket(self, scheduled: list[ScheduledSeq], host: HostInputs) -> int | None:
        graphs = self.graphs
        if graphs is None or host.max_query_len != 1 or len(host.sample_indices) != len(scheduled):
            return None
        if host.block_tables.shape[1] > graphs.limits.max_blocks:
            return None
        if host.lora is not None and host.lora.page_tables.shape[1] > graphs.limits.max_adapter_pages:
            return None
        bucket = graphs.bucket_for(len(scheduled))
        # More adapters than the graph has slots for cannot happen under the scheduler's max_loras; a
        # graph must still never be replayed for a batch it does not fit.
        if bucket is not None and host.lora is not None and \
                host.lora.page_tables.shape[0] > graphs.limits.lora_slots(bucket):
            return None
        return bucket

    def _replay(self, bucket: int, host: HostInputs, batch_size: int) -> Tensor:
        static, n = self.graphs.static, batch_size
        static.input_ids[:n].copy_(host.input_ids, non_blocking=True)
        static.positions[:n].copy_(host.positions, non_blocking=True)
        static.slot_mapping[:bucket].fill_(-1)
        static.slot_mapping[:n].copy_(host.slot_mapping, non_blocking=True)
        static.context_lens[:bucket].zero_()
        static.context_lens[:n].copy_(host.context_lens, non_blocking=True)
        static.block_tables[:n, :host.block_tables.shape[1]].copy_(host.block_tables, non_blocking=True)
        few = host.lora is not None and self.graphs.uses_few(bucket, host.lora.page_tables.shape[0])
        if host.lora is not None:
            self._fill_lora(host.lora, bucket, n, few)
        return self.graphs.replay(bucket, host.lora is not None, n, few)

    def _fill_lora(self, lora: HostLora, bucket: int, n: int, few: bool) -> None:
        static, slots = self.graphs.static, lora.page_tables.shape[0]
        static.token_slots[:bucket].fill_(-1)
        static.token_slots[:n].copy_(lora.token_slots, non_blocking=True)
        static.page_tables[:slots, :lora.page_tables.shape[1]].copy_(lora.page_tables, non_blocking=True)
        for name in ("ranks", "a_offsets", "b_offsets", "scalings"):
            getattr(static, name)[:, :, :slots].copy_(getattr(lora, name), non_blocking=True)
        static.ranks[:, :, slots:self.graphs.limits.lora_slots(bucket, few)].zero_()   # the graph's other slots


@torch.inference_mode()
def profile_activation_bytes(model: LlamaForCausalLM, shape: PoolShape, num_tokens: int, dtype: torch.dtype,
                             device: torch.device) -> int:
    """Peak CUDA memory of one prefill of `num_tokens` tokens beyond the weights and its own KV pages."""
    pages = -(-num_tokens // shape.page_size)
    runner = ModelRunner(model, PoolShape(shape.num_layers, pages, shape.page_size, shape.num_kv_heads,
                                          shape.head_dim), dtype, device)
    positions = torch.arange(num_tokens)
    host = HostInputs(torch.zeros(num_tokens, dtype=torch.long), positions, positions.clone(),
                      torch.arange(pages, dtype=torch.int32)[None], torch.tensor([0, num_tokens], dtype=torch.int32),
                      torch.tensor([num_tokens], dtype=torch.int32), torch.tensor([num_tokens - 1]), num_tokens,
                      num_tokens, None)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.model(runner.to_device(host), runner.pool, runner.attention)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
