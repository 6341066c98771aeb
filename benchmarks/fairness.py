"""Fair share between tenants: one S-LoRA-style trace of four tenants of unequal load, served first come first
served (`fcfs`) and by virtual token counters (`vtc`, Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024), on the same trace in one invocation.

Trace: tenant "heavy" sends at 4x the rate of each of "light-1", "light-2", "light-3". Each tenant's arrivals
are Poisson (exponential gaps, a seeded stream per tenant) over the same window; prompts are uniform in
[8, 512] tokens and outputs in [8, 256] (S-LoRA's synthetic trace draws both in [8, 512]; shorter outputs keep
a GPU run within minutes), seeded. Each tenant owns four adapters, ranks 8, 16, 32 and 64 on q/k/v/o,
registered in its own namespace, and each of its requests picks one of them uniformly. The rates are set from
the engine's capacity C (requests/s), measured first: requests of the same lengths and adapters queued all at
once, C their rate of completion while the batch is full (from the batch-th finish to the batch-th from last).
The heavy tenant offers `--load` x C (default 1.05: alone it is more than the engine can serve), each light one
a quarter of that, so the light tenants together offer 0.79 C and the total is 1.84 C. A queue builds for the
whole window (240 s simulated, 25 s on a GPU, 20 s on the CPU), then drains. Each light tenant offers a little
more than its fair quarter (0.2625 C), so under vtc the light ones queue too, slowly, by that excess.

Reported, per policy:
  served tokens    each tenant's prompt tokens computed plus tokens generated, cumulative, at 10 times
  max_gap          the largest difference of weighted service (1 per prompt token computed, 2 per token
                   generated, an adapter brought into the pool its pages' tokens at 1) between two tenants over
                   a period in which both were continuously backlogged (a request of each waiting for
                   admission after every step of it): the range of their service difference over the period.
                   Against VTC's bound 2 * max(w_p * L_in, w_q * M), L_in the longest prompt charged at once
                   with its adapter's pages, M the tokens the running batch can hold (Theorem 4.4).
  TTFT             from a request's arrival to its first token; p50 and p99 of the three light tenants
                   together and of the heavy one; the goal is a light p99 at least 5x lower under vtc
  throughput       generated tokens and all tokens (prompt + generated) per second, from the trace's start to
                   the last request's end; the goal is under 3% lost by vtc

Two engines:
  --engine sim   slora's scheduler and page pool in the simulator (torch-free, seconds on a CPU); each step
                 costs memsim's Llama-3-8B model on an H100/H200-like GPU: (weights + the batch's KV + its
                 distinct adapters) / HBM bandwidth, plus every prompt token computed at 2 x 8.03e9 FLOPs /
                 (50% of 989 TFLOP/s), plus adapter loads at 50 GB/s. Engine defaults: 64 sequences, 8,192
                 tokens a step, 16-token pages, a 40 GB pool (an 80 GB GPU less weights and headroom). The
                 service is counted from each step's scheduled tokens and adapter loads.
  --engine gpu   the real Engine (built once per policy, warmed up by the capacity measurement) on a
                 Llama-3-8B-shaped model with random bf16 weights and PEFT adapters with random weights;
                 arrivals replayed on the wall clock: requests whose arrival time has passed are added, one
                 step runs, first tokens are timed when a step returns them. The service is read from the
                 engine's per-tenant accounts (`Engine.tenant_shares()`). `--device cpu` runs the same code
                 on slora-tiny-llama with shorter lengths (prompts [8, 64], outputs [8, 32]).

--quick: a short window (the smoke test). The JSON holds the raw numbers; the tables go to stdout; in sim mode
a plot of the served tokens goes next to the JSON (.png) when matplotlib is installed.

    python benchmarks/fairness.py [--engine sim|gpu] [--device cpu|cuda] [--quick] [--load 1.05]
                                  [--duration S] [--capacity REQ_S] [--engine-arg KEY=VALUE ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
from common import (
    ATTENTION,
    LOAD_THREADS,
    RESULTS,
    add_engine_arg,
    default_out,
    machine,
    make_prompts,
    prepare_model,
    print_table,
    pyplot,
    save_figure,
    write_peft_adapter,
)
from memsim import CostModel
from workloads import RANKS, gamma_arrivals

from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from slora.core.sequence import AdapterRef, Sequence, SequenceStatus
from slora.core.simulator import SimRequest, StepObserver, simulate

if TYPE_CHECKING:
    from common import ModelSetup

    from slora.core.fair_share import TenantShare
    from slora.engine import Engine

LOG = logging.getLogger("benchmarks.fairness")
POLICIES = ("fcfs", "vtc")
HEAVY = "heavy"
LIGHTS = ("light-1", "light-2", "light-3")
TENANTS = (HEAVY, *LIGHTS)
HEAVY_FACTOR = 4                  # the heavy tenant's rate over each light tenant's
W_P, W_Q = 1.0, 2.0               # the scheduler's default prompt_cost and output_cost
PAGE_SIZE = 16
SIM_POOL_GB = 40.0
SIM_STEP_TOKENS = 8192            # the engine's max_num_batched_tokens on CUDA
TIME_POINTS = 10
SEED = 42
DEFAULT_LOAD = 1.05


# ---- sizes and the trace ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """One run's trace window, lengths and batch."""
    duration_s: float                  # arrivals fall in [0, duration_s)
    prompt_range: tuple[int, int]      # both ends included
    output_range: tuple[int, int]
    max_num_seqs: int
    calibration_requests: int          # sent at once to measure the capacity (and, on an engine, to warm it up)

    @property
    def max_len(self) -> int:
        return self.prompt_range[1] + self.output_range[1]


# (device, quick) -> sizes. The GPU window keeps a run of both policies (each about 1.8 windows long: the
# window, then the queue's drain) near three minutes with the engines' start; the CPU's lengths suit the tiny model.
SIZES = MappingProxyType({
    ("sim", False): Sizes(240.0, (8, 512), (8, 256), 64, 1024),
    ("sim", True): Sizes(40.0, (8, 512), (8, 256), 64, 256),
    ("cuda", False): Sizes(25.0, (8, 512), (8, 256), 64, 256),
    ("cuda", True): Sizes(5.0, (8, 512), (8, 256), 64, 128),
    ("cpu", False): Sizes(20.0, (8, 64), (8, 32), 16, 64),
    ("cpu", True): Sizes(4.0, (8, 64), (8, 32), 8, 32),
})


@dataclass(frozen=True)
class TraceRequest:
    tenant: str
    adapter: str                       # the tenant's adapter name (in its own namespace)
    prompt_len: int
    output_len: int
    arrival: float                     # seconds from the trace's start


def adapter_names(tenant: str) -> list[str]:
    return [f"{tenant}-r{rank}" for rank in RANKS]


def adapter_rank(name: str) -> int:
    return int(name.rsplit("-r", 1)[1])


def tenant_rates(capacity: float, load: float) -> dict[str, float]:
    """Requests/s per tenant: the heavy one `load` x the capacity, each light one a fourth of that."""
    heavy = load * capacity
    return {HEAVY: heavy, **dict.fromkeys(LIGHTS, heavy / HEAVY_FACTOR)}


def poisson_arrivals(rng: np.random.RandomState, rate: float, duration_s: float) -> np.ndarray:
    """Arrival times of a Poisson process over [0, duration_s): exponential gaps (Gamma with cv 1)."""
    expected = rate * duration_s
    draws = gamma_arrivals(rng, int(expected + 8 * expected ** 0.5 + 16), rate, cv=1.0)
    return draws[draws < duration_s]


def tenant_trace(tenant: str, rate: float, sizes: Sizes, seed: int) -> list[TraceRequest]:
    rng = np.random.RandomState(seed)
    arrivals = poisson_arrivals(rng, rate, sizes.duration_s)
    count = len(arrivals)
    prompts = rng.randint(sizes.prompt_range[0], sizes.prompt_range[1] + 1, count)
    outputs = rng.randint(sizes.output_range[0], sizes.output_range[1] + 1, count)
    names = adapter_names(tenant)
    picks = rng.randint(0, len(names), count)
    return [TraceRequest(tenant, names[a], int(p), int(o), float(t))
            for a, p, o, t in zip(picks, prompts, outputs, arrivals)]


def build_trace(rates: dict[str, float], sizes: Sizes, seed: int = SEED) -> list[TraceRequest]:
    """Every tenant's requests from a stream of its own (seed + its index), merged by arrival."""
    requests = [r for i, tenant in enumerate(TENANTS) for r in tenant_trace(tenant, rates[tenant], sizes, seed + i)]
    return sorted(requests, key=lambda r: r.arrival)


def calibration_trace(sizes: Sizes, seed: int = SEED + 100) -> list[TraceRequest]:
    """`calibration_requests` at time 0, the same lengths for every tenant (their counters stay level), the tenants
    and their adapters taken in turn."""
    rng = np.random.RandomState(seed)
    per_tenant = sizes.calibration_requests // len(TENANTS)
    prompts = rng.randint(sizes.prompt_range[0], sizes.prompt_range[1] + 1, per_tenant)
    outputs = rng.randint(sizes.output_range[0], sizes.output_range[1] + 1, per_tenant)
    return [TraceRequest(tenant, adapter_names(tenant)[i % len(RANKS)], int(prompts[i]), int(outputs[i]), 0.0)
            for i in range(per_tenant) for tenant in TENANTS]


# ---- what a run records -------------------------------------------------------------------------------------
class Backlog:
    """Which tenants have a sequence waiting for admission, read off each tenant's sequences in arrival order:
    those no longer waiting are dropped from the front, so a step costs about its admissions, not a walk over
    a waiting queue of thousands. A preempted sequence waits again: `requeue` puts it back in front."""

    def __init__(self) -> None:
        self._seqs: dict[str, deque[Sequence]] = {tenant: deque() for tenant in TENANTS}

    def add(self, seq: Sequence) -> None:
        self._seqs[str(seq.tenant)].append(seq)

    def requeue(self, seq: Sequence) -> None:
        self._seqs[str(seq.tenant)].appendleft(seq)

    def reset(self, waiting: Iterable[Sequence]) -> None:
        """Start again from the scheduler's waiting queue itself (after preemptions the engine does not list)."""
        self._seqs = {tenant: deque() for tenant in TENANTS}
        for seq in waiting:
            self.add(seq)

    def waiting(self) -> tuple[bool, ...]:
        return tuple(self._waits(self._seqs[tenant]) for tenant in TENANTS)

    @staticmethod
    def _waits(seqs: deque[Sequence]) -> bool:
        while seqs and seqs[0].status is not SequenceStatus.WAITING:
            seqs.popleft()
        return bool(seqs)


@dataclass
class ServiceLog:
    """After every step: the clock, each tenant's served tokens and weighted service so far (in TENANTS order),
    and whether each had a request waiting."""
    times: list[float] = field(default_factory=list)
    tokens: list[tuple[int, ...]] = field(default_factory=list)
    service: list[tuple[float, ...]] = field(default_factory=list)
    backlogged: list[tuple[bool, ...]] = field(default_factory=list)

    def record(self, clock: float, tokens: tuple[int, ...], service: tuple[float, ...],
               backlogged: tuple[bool, ...]) -> None:
        self.times.append(clock)
        self.tokens.append(tokens)
        self.service.append(service)
        self.backlogged.append(backlogged)


@dataclass
class Tally:
    """Each tenant's served tokens and weighted service, counted from the steps' scheduled work (sim mode)."""
    owners: dict[str, str]             # adapter version -> tenant
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0))
    service: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0.0))

    def count(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            tenant, prompt, generated = str(item.seq.tenant), item.prompt_tokens, int(item.completes)
            self.tokens[tenant] += prompt + generated
            self.service[tenant] += W_P * prompt + W_Q * generated
        for version, pages in out.adapters_to_load:
            self.service[self.owners[version]] += W_P * len(pages) * PAGE_SIZE

    def row(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        return tuple(self.tokens[t] for t in TENANTS), tuple(self.service[t] for t in TENANTS)


def share_row(shares: dict[str | None, TenantShare], page_size: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Served tokens and weighted service per tenant from the engine's accounts (gpu mode)."""
    def of(tenant: str) -> tuple[int, float]:
        share = shares.get(tenant)
        if share is None:
            return 0, 0.0
        served = W_P * (share.prompt_tokens + share.adapter_pages * page_size) + W_Q * share.output_tokens
        return share.prompt_tokens + share.output_tokens, served
    pairs = [of(t) for t in TENANTS]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


@dataclass
class Run:
    """One policy over the trace: first-token times by request index, the makespan and the service log."""
    policy: str
    first_token: dict[int, float]
    makespan_s: float
    log: ServiceLog
    preemptions: int
    steps: int
    extra: dict[str, Any] = field(default_factory=dict)


# ---- sim mode -----------------------------------------------------------------------------------------------
@dataclass
class WatchedScheduler(Scheduler):
    """The scheduler, telling a Backlog of every sequence it is given (simulate() makes the sequences)."""
    backlog: Backlog = field(default_factory=Backlog)

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        self.backlog.add(seq)


@dataclass(frozen=True)
class SimSetup:
    cost: CostModel
    refs: dict[str, AdapterRef]          # "tenant/adapter" -> its reference
    adapter_bytes: dict[str, int]        # version -> bytes of its weights
    num_pages: int


def sim_setup(cost: CostModel = CostModel()) -> SimSetup:
    model = cost.model
    refs, sizes = {}, {}
    for tenant in TENANTS:
        for name in adapter_names(tenant):
            rank = adapter_rank(name)
            refs[f"{tenant}/{name}"] = AdapterRef(f"{tenant}/{name}", model.adapter_pages(rank, PAGE_SIZE))
            sizes[f"{tenant}/{name}"] = model.adapter_bytes(rank)
    num_pages = int(SIM_POOL_GB * 1e9 // (PAGE_SIZE * model.kv_bytes_per_token))
    return SimSetup(cost, refs, sizes, num_pages)


def step_seconds(setup: SimSetup) -> Callable[[SchedulerOutput, Scheduler], float]:
    """memsim's decode cost (weights, the batch's KV and distinct adapters read once), every prompt token computed
    at the prefill FLOP rate memsim gives recomputation, and adapter loads over the host link."""
    cost = setup.cost

    def seconds(out: SchedulerOutput, scheduler: Scheduler) -> float:
        live = sum(item.seq.num_computed_tokens + item.num_tokens for item in out.scheduled)
        prompt = sum(item.prompt_tokens for item in out.scheduled)
        versions = {item.seq.adapter.version for item in out.scheduled if item.seq.adapter is not None}
        read = sum(setup.adapter_bytes[v] for v in versions)
        loaded = sum(setup.adapter_bytes[v] for v, _ in out.adapters_to_load)
        return cost.decode_s(live, read) + cost.recompute_s(prompt) + cost.load_s(loaded)
    return seconds


def sim_scheduler(policy: str, setup: SimSetup, sizes: Sizes) -> WatchedScheduler:
    config = SchedulerConfig(max_num_seqs=sizes.max_num_seqs, max_num_batched_tokens=SIM_STEP_TOKENS,
                             page_size=PAGE_SIZE, scheduling_policy=policy, prompt_cost=W_P, output_cost=W_Q)
    return WatchedScheduler(config, PageAllocator(setup.num_pages, PAGE_SIZE))


def sim_requests(trace: list[TraceRequest], setup: SimSetup) -> list[SimRequest]:
    return [SimRequest(r.prompt_len, r.output_len, setup.refs[f"{r.tenant}/{r.adapter}"], r.arrival, r.tenant)
            for r in trace]


def sim_observer(scheduler: WatchedScheduler, tally: Tally, log: ServiceLog) -> StepObserver:
    def observe(out: SchedulerOutput, clock: float) -> None:
        for seq in out.preempted:
            scheduler.backlog.requeue(seq)
        tally.count(out)
        log.record(clock, *tally.row(), scheduler.backlog.waiting())
    return observe


def run_sim(policy: str, trace: list[TraceRequest], setup: SimSetup, sizes: Sizes) -> Run:
    started = time.perf_counter()
    scheduler = sim_scheduler(policy, setup, sizes)
    tally, log = Tally({ref.version: key.split("/")[0] for key, ref in setup.refs.items()}), ServiceLog()
    result = simulate(scheduler, sim_requests(trace, setup), step_seconds(setup),
                      observe=sim_observer(scheduler, tally, log))
    assert not scheduler.has_unfinished(), "the simulation stopped before every request finished"
    check_tally(scheduler, tally)
    LOG.info("sim %s: %d requests, %d steps, %.1f simulated s, %.1f s wall", policy, len(trace), result.steps,
             result.elapsed, time.perf_counter() - started)
    return Run(policy, result.first_token_times, result.elapsed, log, scheduler.num_preemptions, result.steps)


def check_tally(scheduler: Scheduler, tally: Tally) -> None:
    """The service counted here from the steps equals the scheduler's own accounts (recomputation after a
    preemption is counted here and charged to nobody there, so only without preemptions)."""
    if scheduler.num_preemptions:
        return
    _, charged = share_row(scheduler.shares(), PAGE_SIZE)
    counted = tuple(tally.service[t] for t in TENANTS)
    assert np.allclose(charged, counted), f"service counted {counted} but charged {charged}"


def sim_capacity(setup: SimSetup, sizes: Sizes) -> float:
    """Requests/s the simulated engine serves with every calibration request queued at once."""
    scheduler = sim_scheduler("fcfs", setup, sizes)
    result = simulate(scheduler, sim_requests(calibration_trace(sizes), setup), step_seconds(setup))
    return steady_rate(result.finish_times, sizes.max_num_seqs)


def steady_rate(finish_times: list[float], batch: int) -> float:
    """Requests/s between the `batch`-th finish and the `batch`-th from last, of requests all queued at once: the
    batch full and refilled all along, past the start (every row's prefill at once) and before the drain."""
    times = sorted(finish_times)
    first, last = batch, len(times) - batch
    if last <= first:
        raise ValueError(f"{len(times)} requests are too few to measure a batch of {batch}")
    return (last - first) / (times[last - 1] - times[first - 1])


def sim_bound(setup: SimSetup, sizes: Sizes) -> dict[str, float]:
    largest_adapter = max(ref.num_pages for ref in setup.refs.values())
    batch_tokens = min(setup.num_pages * PAGE_SIZE, sizes.max_num_seqs * sizes.max_len)
    return bound(sizes.prompt_range[1] + largest_adapter * PAGE_SIZE, batch_tokens)


def bound(l_in: int, batch_tokens: int) -> dict[str, float]:
    """VTC's bound on the service gap of two backlogged tenants: 2 * max(w_p * L_in, w_q * M)."""
    return {"l_in": l_in, "m": batch_tokens, "value": 2 * max(W_P * l_in, W_Q * batch_tokens)}


def sim_mode(args: argparse.Namespace, sizes: Sizes) -> dict[str, Any]:
    setup = sim_setup()
    capacity = args.capacity or sim_capacity(setup, sizes)
    trace = build_trace(tenant_rates(capacity, args.load), sizes)
    LOG.info("capacity %.1f req/s; %d requests over %.0f s", capacity, len(trace), sizes.duration_s)
    runs = {policy: run_sim(policy, trace, setup, sizes) for policy in POLICIES}
    engine = {"max_num_seqs": sizes.max_num_seqs, "max_num_batched_tokens": SIM_STEP_TOKENS,
              "page_size": PAGE_SIZE, "num_pages": setup.num_pages, "pool_gb": SIM_POOL_GB,
              "cost_model": asdict(setup.cost)}
    return report(trace, runs, capacity, args.load, sizes, sim_bound(setup, sizes), engine)


# ---- gpu mode (the real engine) -----------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSetup:
    model: ModelSetup
    adapters: dict[str, list[tuple[str, Path]]]      # tenant -> (adapter name, PEFT folder)
    sizes: Sizes
    engine_args: dict[str, Any]


def write_tenant_adapters(root: Path, setup: ModelSetup) -> dict[str, list[tuple[str, Path]]]:
    """Each tenant's four PEFT folders (random weights, q/k/v/o), seeded by tenant and rank."""
    def write(item: tuple[int, str]) -> Path:
        seed, name = item
        return write_peft_adapter(root / name, setup.raw, adapter_rank(name), ATTENTION, seed, setup.dtype)

    named = [(SEED + 10 * t + r, name) for t, tenant in enumerate(TENANTS)
             for r, name in enumerate(adapter_names(tenant))]
    with ThreadPoolExecutor(LOAD_THREADS) as pool:      # random draws and safetensors writes release the GIL
        paths = dict(zip((name for _, name in named), pool.map(write, named)))
    return {tenant: [(name, paths[name]) for name in adapter_names(tenant)] for tenant in TENANTS}


def new_engine(policy: str, setup: EngineSetup) -> Engine:
    from slora.config import engine_config
    from slora.engine import Engine
    from slora.models.builtin import TINY_MODEL

    model = setup.model
    options = {"model": str(model.folder) if model.dummy else TINY_MODEL, "device": model.device,
               "max_num_seqs": setup.sizes.max_num_seqs, "max_model_len": setup.sizes.max_len,
               "max_lora_rank": max(RANKS), "seed": SEED, "scheduling_policy": policy,
               "vtc_prompt_cost": W_P, "vtc_output_cost": W_Q,
               **({"load_format": "dummy"} if model.dummy else {}), **setup.engine_args}
    engine = Engine(engine_config(**options))
    for tenant, adapters in setup.adapters.items():
        for name, folder in adapters:
            engine.adapters.load(name, folder, owner=tenant)
    return engine


@dataclass
class Replay:
    """The wall-clock replay of a trace on an engine."""
    engine: Engine
    trace: list[TraceRequest]
    prompts: list[list[int]]
    backlog: Backlog = field(default_factory=Backlog)
    log: ServiceLog = field(default_factory=ServiceLog)
    first_token: dict[int, float] = field(default_factory=dict)
    finish_times: list[float] = field(default_factory=list)
    preemptions_seen: int = 0
    # The accounts as the replay starts: the engine's counters hold the warm-up's service too.
    base: tuple[tuple[int, ...], tuple[float, ...]] = ((), ())

    def __post_init__(self) -> None:
        self.preemptions_seen = self.engine.scheduler.num_preemptions
        self.base = share_row(self.engine.tenant_shares(), PAGE_SIZE)

    def add(self, index: int) -> None:
        from slora import SamplingParams

        request = self.trace[index]
        params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
        self.engine.add_request(str(index), self.prompts[index], params, adapter=request.adapter,
                                owner=request.tenant)
        self.backlog.add(self.engine.requests[str(index)].seqs[0])

    def step(self, t0: float) -> None:
        outputs = self.engine.step()
        clock = time.perf_counter() - t0
        for output in outputs:
            if output.token_ids:
                self.first_token.setdefault(int(output.request_id), clock)
            if output.finished:
                self.finish_times.append(clock)
        self._record(clock)

    def _record(self, clock: float) -> None:
        scheduler = self.engine.scheduler
        if scheduler.num_preemptions != self.preemptions_seen:      # rare: walk the waiting queue once
            self.preemptions_seen = scheduler.num_preemptions
            self.backlog.reset(scheduler.waiting)
        tokens, service = share_row(self.engine.tenant_shares(), PAGE_SIZE)
        self.log.record(clock, tuple(n - b for n, b in zip(tokens, self.base[0])),
                        tuple(s - b for s, b in zip(service, self.base[1])), self.backlog.waiting())

    def run(self) -> float:
        """Every request added once its arrival time has passed, steps until all have finished; the makespan."""
        pending, t0 = deque(range(len(self.trace))), time.perf_counter()
        while pending or self.engine.has_unfinished():
            now = time.perf_counter() - t0
            while pending and self.trace[pending[0]].arrival <= now:
                self.add(pending.popleft())
            if self.engine.has_unfinished():
                self.step(t0)
            else:
                time.sleep(max(0.0, self.trace[pending[0]].arrival - now))
        return time.perf_counter() - t0


def prompts_of(trace: list[TraceRequest], vocab_size: int, seed: int) -> list[list[int]]:
    return make_prompts(trace, vocab_size, seed)       # reads only prompt_len


def engine_capacity(engine: Engine, setup: EngineSetup) -> float:
    """Requests/s with every calibration request queued at once: the warm-up of the engine too (its graphs,
    kernels and adapters), the same lengths per tenant so that no counter starts ahead."""
    trace = calibration_trace(setup.sizes)
    replay = Replay(engine, trace, prompts_of(trace, setup.model.vocab_size, SEED + 7))
    replay.run()
    return steady_rate(replay.finish_times, setup.sizes.max_num_seqs)


def run_engine(policy: str, trace: list[TraceRequest], prompts: list[list[int]], engine: Engine) -> Run:
    replay = Replay(engine, trace, prompts)
    makespan = replay.run()
    finished = len(replay.finish_times)
    assert finished == len(trace), f"{finished} of {len(trace)} requests finished"
    LOG.info("engine %s: %d requests in %.1f s, %d steps", policy, len(trace), makespan, len(replay.log.times))
    return Run(policy, replay.first_token, makespan, replay.log, engine.scheduler.num_preemptions,
               len(replay.log.times), {"num_pages": engine.allocator.num_pages})


def free_device_memory() -> None:
    """Collect a dropped engine and hand its cached GPU memory back to the device."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_bound(engine: Engine, setup: EngineSetup) -> dict[str, float]:
    pages = [engine.adapters.resolve(name, tenant).num_pages
             for tenant, adapters in setup.adapters.items() for name, _ in adapters]
    page_size = engine.config.page_size
    batch_tokens = min(engine.allocator.num_pages * page_size, setup.sizes.max_num_seqs * setup.sizes.max_len)
    return bound(setup.sizes.prompt_range[1] + max(pages) * page_size, batch_tokens)


@dataclass
class EnginePass:
    """What the passes over the policies share: the trace and its prompts, set by the first engine's capacity."""
    setup: EngineSetup
    args: argparse.Namespace
    trace: list[TraceRequest] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    capacities: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)

    def run(self, policy: str) -> Run:
        engine = new_engine(policy, self.setup)
        self.capacities[policy] = engine_capacity(engine, self.setup)
        if not self.trace:
            self._make_trace(self.args.capacity or self.capacities[policy])
            self.bound = engine_bound(engine, self.setup)
        done = run_engine(policy, self.trace, self.prompts, engine)
        del engine              # the only reference: its GPU memory goes back before the next engine is sized
        free_device_memory()
        return done

    def _make_trace(self, capacity: float) -> None:
        self.trace = build_trace(tenant_rates(capacity, self.args.load), self.setup.sizes)
        self.prompts = prompts_of(self.trace, self.setup.model.vocab_size, SEED)
        LOG.info("capacity %.1f req/s; %d requests over %.0f s", capacity, len(self.trace),
                 self.setup.sizes.duration_s)


def gpu_mode(args: argparse.Namespace, device: str, sizes: Sizes) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="slora-fairness-") as tmp:
        model = prepare_model(device, Path(tmp))
        setup = EngineSetup(model, write_tenant_adapters(Path(tmp) / "adapters", model), sizes,
                            dict(args.engine_arg))
        passes = EnginePass(setup, args)
        runs = {policy: passes.run(policy) for policy in POLICIES}
    capacity = args.capacity or passes.capacities[POLICIES[0]]
    engine = {"model": model.description, "max_num_seqs": sizes.max_num_seqs, "max_model_len": sizes.max_len,
              "engine_args": setup.engine_args, "capacity_req_s_by_policy": passes.capacities,
              "num_pages": {p: r.extra["num_pages"] for p, r in runs.items()}}
    return report(passes.trace, runs, capacity, args.load, sizes, passes.bound, engine)


# ---- the report ---------------------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    p50, p99 = np.percentile(np.asarray(values), (50, 99))
    return {"p50": float(p50), "p99": float(p99), "mean": float(np.mean(values))}


def ttfts(trace: list[TraceRequest], run: Run, tenants: Iterable[str]) -> list[float]:
    wanted = set(tenants)
    return [run.first_token[i] - r.arrival for i, r in enumerate(trace) if r.tenant in wanted]


def backlog_periods(both: np.ndarray) -> Iterator[slice]:
    """The maximal runs of True in a boolean array, as slices."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], both.astype(np.int8), [0]))))
    for start, stop in zip(edges[::2], edges[1::2]):
        yield slice(int(start), int(stop))


def max_gap(log: ServiceLog) -> dict[str, Any]:
    """The largest range of the service difference of two tenants over a period both were backlogged, and the
    longest such period (seconds) of any pair: how long the bound was put to the test."""
    service, waiting, times = np.asarray(log.service), np.asarray(log.backlogged), np.asarray(log.times)
    best = {"value": 0.0, "pair": None, "longest_together_s": 0.0}
    for i in range(len(TENANTS)):
        for j in range(i + 1, len(TENANTS)):
            diff = service[:, i] - service[:, j]
            for period in backlog_periods(waiting[:, i] & waiting[:, j]):
                gap = float(diff[period].max() - diff[period].min())
                span = float(times[period.stop - 1] - times[period.start])
                best["longest_together_s"] = max(best["longest_together_s"], span)
                if gap > best["value"]:
                    best.update(value=gap, pair=[TENANTS[i], TENANTS[j]])
    return best


def served_over_time(log: ServiceLog, points: np.ndarray) -> list[list[int]]:
    """Each tenant's served tokens at each time point (the last step ended by then)."""
    times, tokens = np.asarray(log.times), np.asarray(log.tokens)
    at = np.searchsorted(times, points, side="right") - 1
    return [[0] * len(TENANTS) if k < 0 else tokens[k].tolist() for k in at]


def policy_row(trace: list[TraceRequest], run: Run, points: np.ndarray) -> dict[str, Any]:
    generated = sum(r.output_len for r in trace)
    prompt = sum(r.prompt_len for r in trace)
    return {"makespan_s": run.makespan_s, "generated_tokens": generated, "prompt_tokens": prompt,
            "gen_tok_s": generated / run.makespan_s, "total_tok_s": (generated + prompt) / run.makespan_s,
            "ttft_s": {tenant: percentiles(ttfts(trace, run, [tenant])) for tenant in TENANTS},
            "light_ttft_s": percentiles(ttfts(trace, run, LIGHTS)),
            "heavy_ttft_s": percentiles(ttfts(trace, run, [HEAVY])),
            "max_gap": max_gap(run.log), "served_tokens": served_over_time(run.log, points),
            "preemptions": run.preemptions, "steps": run.steps}


def summary(rows: dict[str, dict[str, Any]], limit: dict[str, float]) -> dict[str, Any]:
    fcfs, vtc = rows["fcfs"], rows["vtc"]
    return {"light_p99_fcfs_over_vtc": fcfs["light_ttft_s"]["p99"] / vtc["light_ttft_s"]["p99"],
            "gen_tok_s_vtc_over_fcfs": vtc["gen_tok_s"] / fcfs["gen_tok_s"],
            "total_tok_s_vtc_over_fcfs": vtc["total_tok_s"] / fcfs["total_tok_s"],
            "vtc_gap_within_bound": vtc["max_gap"]["value"] <= limit["value"],
            "goals": {"light_p99_ratio_at_least": 5.0, "throughput_loss_below": 0.03}}


def report(trace: list[TraceRequest], runs: dict[str, Run], capacity: float, load: float, sizes: Sizes,
           limit: dict[str, float], engine: dict[str, Any]) -> dict[str, Any]:
    points = np.linspace(0, max(r.makespan_s for r in runs.values()), TIME_POINTS + 1)[1:]
    rows = {policy: policy_row(trace, run, points) for policy, run in runs.items()}
    rates = tenant_rates(capacity, load)
    counts = {tenant: sum(r.tenant == tenant for r in trace) for tenant in TENANTS}
    return {"trace": {"tenants": list(TENANTS), "heavy_factor": HEAVY_FACTOR, "arrivals": "Poisson per tenant",
                      "duration_s": sizes.duration_s, "prompt_range": list(sizes.prompt_range),
                      "output_range": list(sizes.output_range), "adapter_ranks": list(RANKS),
                      "adapter_targets": list(ATTENTION), "capacity_req_s": capacity, "load": load,
                      "rates_req_s": rates, "requests": counts, "seed": SEED},
            "engine": engine, "costs": {"prompt": W_P, "output": W_Q}, "bound": limit,
            "time_points_s": points.tolist(), "policies": rows, "summary": summary(rows, limit)}


def summary_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    def row(policy: str, values: dict[str, Any]) -> dict[str, Any]:
        light, heavy = values["light_ttft_s"], values["heavy_ttft_s"]
        return {"policy": policy, "gen_tok_s": values["gen_tok_s"], "total_tok_s": values["total_tok_s"],
                "light_ttft_p50_s": light["p50"], "light_ttft_p99_s": light["p99"],
                "heavy_ttft_p50_s": heavy["p50"], "heavy_ttft_p99_s": heavy["p99"],
                "max_gap": values["max_gap"]["value"], "bound": data["bound"]["value"],
                "together_s": values["max_gap"]["longest_together_s"], "preemptions": values["preemptions"]}
    return [row(policy, values) for policy, values in data["policies"].items()]


def served_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for k, t in enumerate(data["time_points_s"]):
        row: dict[str, Any] = {"t_s": t}
        for policy, values in data["policies"].items():
            row.update({f"{policy}:{tenant}": n for tenant, n in zip(TENANTS, values["served_tokens"][k])})
        rows.append(row)
    return rows


def ratio_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    s = data["summary"]
    return [{"light_p99_fcfs/vtc": s["light_p99_fcfs_over_vtc"], "gen_tok_s_vtc/fcfs": s["gen_tok_s_vtc_over_fcfs"],
             "total_tok_s_vtc/fcfs": s["total_tok_s_vtc_over_fcfs"], "vtc_gap<=bound": s["vtc_gap_within_bound"]}]


def plot(data: dict[str, Any], path: Path) -> None:
    """Each tenant's served tokens over time, one panel per policy."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(POLICIES), figsize=(12, 4.5), sharey=True)
    times = data["time_points_s"]
    for ax, policy in zip(axes, POLICIES):
        served = np.asarray(data["policies"][policy]["served_tokens"])
        for k, tenant in enumerate(TENANTS):
            ax.plot(times, served[:, k], marker="o", label=tenant)
        ax.axvline(data["trace"]["duration_s"], color="grey", linestyle=":", label="arrivals end")
        ax.set_title(policy)
        ax.set_xlabel("seconds")
    axes[0].set_ylabel("served tokens (prompt + generated)")
    axes[0].legend()
    fig.suptitle("Four tenants, heavy at 4x each light's rate, simulated Llama-3-8B")
    save_figure(fig, path, dpi=110)


def machine_name(engine: str) -> str:
    if engine == "sim":
        return f"CPU {platform.processor() or platform.machine()} (simulated GPU)"
    return machine()


def write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    LOG.info("wrote %s", path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("sim", "gpu"), default="sim")
    parser.add_argument("--device", default=None, help="gpu mode: cuda (default when available) or cpu")
    parser.add_argument("--quick", action="store_true", help="a short window (CI)")
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD,
                        help="the heavy tenant's offered load over the capacity (each light one: a fourth of it)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default by mode)")
    parser.add_argument("--capacity", type=float, default=None, help="requests/s, instead of measuring it")
    add_engine_arg(parser, "enforce_eager=true")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default: results/cpu/fairness.json in sim mode, else results/<machine>/)")
    return parser.parse_args(argv)


def device_of(args: argparse.Namespace) -> str:
    if args.engine == "sim":
        return "sim"
    if args.device:
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_path(device: str) -> Path:
    if device == "sim":
        return RESULTS / "cpu" / "fairness.json"
    return default_out("fairness", device)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("slora").setLevel(logging.WARNING)
    device = device_of(args)
    sizes = SIZES[("cuda" if device.startswith("cuda") else device, args.quick)]
    sizes = replace(sizes, duration_s=args.duration or sizes.duration_s)
    started = time.perf_counter()
    data = sim_mode(args, sizes) if device == "sim" else gpu_mode(args, device, sizes)
    data = {"date": time.strftime("%Y-%m-%d"), "machine": machine_name(args.engine), "benchmark": "fairness",
            "mode": args.engine, "device": device, "quick": args.quick, **data,
            "wall_seconds": time.perf_counter() - started}
    out = args.out or default_path(device)
    write(out, data)
    for table in (summary_table(data), ratio_table(data), served_table(data)):
        print_table(table)
    if args.engine == "sim":
        plot(data, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
