"""Shared parts of the simulated benchmarks (`simulate.py`, `ablation.py`): the cost model of
Llama-3-8B on an H200-like GPU, a step-cost function that also measures the pool, and the two
alternative memory policies, built on the project's own scheduler without changing it.

Cost model, per scheduler step:

    decode:     (weights + live tokens x KV bytes per token + distinct adapters' bytes) / HBM bandwidth
    recompute:  tokens recomputed after a preemption x 2 x 8.03e9 FLOPs / (50% of 989 TFLOP/s)
    adapters:   bytes of the adapters loaded this step / 50 GB/s host-to-device

`live tokens` are the context lengths of the scheduled sequences after the step. Other prefill work is
free (the study is about memory, not compute), so the schedulers run with no cap on batched tokens.
Llama-3-8B: 8.03e9 parameters (2 FLOPs each per token), 16.06 GB of bf16 weights, 32 layers x 8 KV heads
x 128 dims x K and V x 2 bytes = 131,072 bytes of KV per token.
"""
from collections.abc import Callable
from dataclasses import dataclass, field

from slora.core.adapter_residency import AdapterResidency
from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler, SchedulerOutput
from slora.core.sequence import AdapterRef, Sequence
from slora.core.simulator import SimRequest
from slora.kernels.layout import align_up

UNCAPPED_TOKENS = 1 << 40              # max_num_batched_tokens when prefill is free


@dataclass(frozen=True)
class ModelShape:
    """Llama-3-8B; LoRA targets q, k, v, o as in S-LoRA's experiments."""

    num_params: float = 8.03e9
    weight_bytes: float = 16.06e9
    num_layers: int = 32
    hidden: int = 4096
    kv_dim: int = 8 * 128                  # num_kv_heads x head_dim
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def page_elems(self, page_size: int) -> int:
        return 2 * page_size * self.num_kv_heads * self.head_dim

    def adapter_elems_per_layer(self, rank: int) -> int:
        """Rows of A then Bᵀ of q, k, v, o, each row aligned as the packer lays them out (DESIGN §2)."""
        h, kv = align_up(self.hidden), align_up(self.kv_dim)
        return rank * ((h + h) + (h + kv) + (h + kv) + (h + h))

    def adapter_pages(self, rank: int, page_size: int) -> int:
        return -(-self.adapter_elems_per_layer(rank) // self.page_elems(page_size))

    def adapter_bytes(self, rank: int) -> int:
        return self.adapter_elems_per_layer(rank) * self.num_layers * self.dtype_bytes


@dataclass(frozen=True)
class CostModel:
    model: ModelShape = ModelShape()
    hbm_bandwidth: float = 3.35e12         # B/s, H200
    peak_flops: float = 989e12             # dense bf16, H100/H200
    prefill_efficiency: float = 0.5
    h2d_bandwidth: float = 50e9            # B/s, host to device

    @property
    def flops_per_token(self) -> float:
        return 2 * self.model.num_params

    def decode_s(self, live_tokens: int, adapter_bytes: int = 0) -> float:
        kv = live_tokens * self.model.kv_bytes_per_token
        return (self.model.weight_bytes + kv + adapter_bytes) / self.hbm_bandwidth

    def recompute_s(self, tokens: int) -> float:
        return tokens * self.flops_per_token / (self.prefill_efficiency * self.peak_flops)

    def load_s(self, num_bytes: int) -> float:
        return num_bytes / self.h2d_bandwidth


@dataclass
class StepMeter:
    """The step-cost function handed to `slora.core.simulator.simulate`; it also measures each step.

    Called after `schedule()` and before the simulator advances the sequences, so a scheduled item
    that completes the sequence's last output token marks a sequence that finishes in this step."""

    cost: CostModel
    adapter_bytes: dict[str, int] = field(default_factory=dict)    # version -> bytes of its weights
    steps: int = 0
    busy_steps: int = 0
    utilisation_sum: float = 0.0
    end_waste: list[int] = field(default_factory=list)
    recomputed_tokens: int = 0
    adapter_loads: int = 0
    seconds_loading: float = 0.0
    seconds_recomputing: float = 0.0
    high_water: dict[int, int] = field(default_factory=dict, repr=False)

    def __call__(self, out: SchedulerOutput, scheduler: Scheduler) -> float:
        self.steps += 1
        page_size = scheduler.config.page_size
        live, recomputed, adapters = 0, 0, set()
        for item in out.scheduled:
            seq, end = item.seq, item.seq.num_computed_tokens + item.num_tokens
            live += end
            recomputed += self._recomputed(seq, end)
            if seq.adapter is not None:
                adapters.add(seq.adapter.version)
            if item.completes and len(seq.output_token_ids) + 1 >= seq.params.max_tokens:
                self.end_waste.append(len(seq.block_table) * page_size - end)
        self._measure_utilisation(live, scheduler)
        return self._seconds(out, live, recomputed, adapters)

    def _recomputed(self, seq: Sequence, end: int) -> int:
        """Tokens of this step below the sequence's high-water mark: computed before a preemption."""
        before = self.high_water.get(seq.seq_id, 0)
        self.high_water[seq.seq_id] = max(before, end)
        return max(0, min(end, before) - seq.num_computed_tokens)

    def _measure_utilisation(self, live: int, scheduler: Scheduler) -> None:
        allocated = sum(len(s.block_table) for s in scheduler.running) * scheduler.config.page_size
        if allocated:
            self.busy_steps += 1
            self.utilisation_sum += live / allocated

    def _seconds(self, out: SchedulerOutput, live: int, recomputed: int, adapters: set[str]) -> float:
        self.recomputed_tokens += recomputed
        loaded = sum(self.adapter_bytes[version] for version, _ in out.adapters_to_load)
        self.adapter_loads += len(out.adapters_to_load)
        load_s, recompute_s = self.cost.load_s(loaded), self.cost.recompute_s(recomputed)
        self.seconds_loading += load_s
        self.seconds_recomputing += recompute_s
        read = sum(self.adapter_bytes[v] for v in adapters)
        return self.cost.decode_s(live, read) + recompute_s + load_s

    @property
    def utilisation(self) -> float:
        return self.utilisation_sum / max(1, self.busy_steps)

    @property
    def mean_end_waste(self) -> float:
        return sum(self.end_waste) / max(1, len(self.end_waste))


@dataclass
class ReservingScheduler(Scheduler):
    """Reservation baselines: at admission a request gets every slot it may ever use, so running
    sequences never grow and are never preempted. `reserve_tokens` = None is the oracle, which
    reserves the request's exact final length (prompt + max_tokens). Meant for page_size 1, where the
    reservation is exact to the token; with larger pages it is rounded up to whole pages."""

    reserve_tokens: int | None = None

    def reservation(self, seq: Sequence) -> int:
        if self.reserve_tokens is None:
            return len(seq.prompt_token_ids) + seq.params.max_tokens
        return self.reserve_tokens

    def pages_to_admit(self, seq: Sequence, matched: list[int] | None = None) -> int:
        page_size = self.config.page_size
        extra = seq.pages_needed(max(seq.num_tokens, self.reservation(seq)), page_size) \
            - seq.pages_needed(seq.num_tokens, page_size)
        return super().pages_to_admit(seq, matched) + extra

    def _grow(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        return super()._grow(seq, max(num_tokens, self.reservation(seq)), out)


@dataclass
class PartitionedScheduler(Scheduler):
    """The pool split in two fixed regions: `allocator` holds only KV, `adapter_allocator` only adapter
    weights. Idle adapters are evicted (LRU) only to make room for other adapters, never for KV, and KV
    pressure preempts sequences (newest first) exactly as in the unified scheduler."""

    adapter_allocator: PageAllocator | None = None

    def __post_init__(self, adapter_pool: AdapterResidency | None) -> None:
        super().__post_init__(adapter_pool)
        if self.adapter_allocator is None:
            raise ValueError("a partitioned scheduler needs an adapter_allocator")
        self.adapters = AdapterResidency(self.adapter_allocator)

    def pages_to_admit(self, seq: Sequence, matched: list[int] | None = None) -> int:
        return seq.pages_needed(seq.num_tokens, self.config.page_size) - len(matched or [])

    def _can_admit(self, seq: Sequence, matched: list[int]) -> bool:
        kv_fits = self.pages_to_admit(seq, matched) + self.watermark_pages <= self.allocator.num_available
        return kv_fits and self._adapter_fits(seq.adapter)

    def _adapter_fits(self, adapter: AdapterRef | None) -> bool:
        if adapter is None or self.adapters.is_resident(adapter.version):
            return True
        available = self.adapter_allocator.num_free + self.adapters.idle_pages(exclude=adapter.version)
        return adapter.num_pages <= available

    def _grow(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        for _ in range(seq.pages_needed(num_tokens, self.config.page_size)):
            while self.allocator.num_available == 0:
                victim = self.running[-1]
                self.preempt(victim, out)
                if victim is seq:
                    return False
            seq.block_table.extend([self.allocator.allocate_kv()])
        return True

    def check(self) -> None:
        self.allocator.check([s.block_table for s in self.running], {})
        self.adapter_allocator.check([], self.adapters.page_tables())


def sim_requests(requests: list, adapter_refs: Callable[[int, int], AdapterRef] | None = None) -> list[SimRequest]:
    """Workload requests (benchmarks/workloads.py) as simulator requests; `adapter_refs(index, rank)`
    names the adapter of a request that has one."""
    sims = []
    for r in requests:
        ref = adapter_refs(r.adapter, r.rank) if adapter_refs and r.adapter is not None else None
        sims.append(SimRequest(r.prompt_len, r.output_len, ref, r.arrival))
    return sims


