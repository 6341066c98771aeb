"""The host's own work per engine step: decode steps, and chunked-prefill steps beside the same decodes
(the question: what does a chunked-prefill step with decodes beside it cost the host, against a decode step).

One engine (the Llama-3-8B shape with random bf16 weights on CUDA, slora-tiny-llama on the CPU), CUDA graphs
as by default, and a step budget of --step-tokens (512: every chunk step fits a mixed-step graph). --batch
requests decode (16-token prompts, long outputs, greedy, ignore_eos), on --adapters rank-16 adapters round
robin (0: the base model). A pass is --prompts blocks of steps. At a block's start one request of
--prompt-len tokens and one output token arrives, on the decoders' first adapter; the steps that chunk it
hold every decode beside their chunk, and the block's last steps are decode steps again. Each
`engine.step()` starts on an idle GPU (--overlapped: right after the one before, the GPU still busy, as in a
serving loop) and is charged to the kind of step it launched (engine_throughput.calls_by_kind); its time is its
wall time less its wait for the tokens of the step before (the host's work), and a step that waited found the
GPU busy (gpu_paced_share). Each block gives its own chunk / decode ratio: the two kinds of steps
run within a fraction of a second of each other, so the host's drift over seconds does not tell between them.
A second pass runs with a timer around each of the engine's phases (PHASES: each timed without the phases
it calls; --fine-phases adds FINE_PHASES: the chunk's parts of scheduling and sampling, and the device copies),
whose means add up to the step's (wait_for_tokens, the waits for the GPU, apart); a third runs under
cProfile, whose functions by own time say where each phase's time goes.
--host-only (CPU) replaces the model's forward by zero logits, with torch on one thread: the steps then time the
host's own work alone. --host-speed also times small units of the same kinds of work alone (plain Python, numpy
over a step's rows, a small torch op on the CPU; HOST_UNITS) and records the host (CPU, clock, usable cores,
cgroup quota and throttling): when one machine's phases are slower than another's by the factor its units are,
the machine is the cause, not the engine.

    python benchmarks/step_host.py [--quick] [--device cpu|cuda] [--batch 64] [--adapters 0|8] [--prompt-len N]
                                   [--idle-ms MS | --overlapped] [--host-only] [--fine-phases] [--host-speed]
                                   [--engine-arg KEY=VALUE ...] [--out FILE]
"""
import argparse
import contextlib
import gc
import importlib
import inspect
import itertools
import logging
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from unittest import mock

import numpy as np
import torch
from common import (
    PROJECTIONS,
    CallTiming,
    ModelSetup,
    add_engine_arg,
    best_us_per_call,
    default_out,
    make_prompts,
    prepare_model,
    print_table,
    write_adapters,
    write_json,
)
from engine_throughput import (
    calls_by_kind,
    kind_rows,
    load_adapters,
    model_kwargs,
    new_llm,
    profiled_call,
    timed_call,
)
from workloads import Request

logger = logging.getLogger("benchmarks.step_host")
T = TypeVar("T")
DECODE_PROMPT = 16


class Scenario(NamedTuple):
    batch: int              # decoding requests
    adapters: int           # their adapters, round robin (0: none)
    prompts: int            # blocks per pass: a chunked prompt each
    prompt_len: int
    step_tokens: int        # the engine's max_num_batched_tokens
    decode_steps: int       # decode steps of a block, after its prompt's chunks
    rounds: int             # timed passes
    # ms the host sleeps after the GPU is idle and before each step: both kinds then start from a like idle
    # host, not from a wait as long as the step before's GPU time (0: none).
    idle_ms: float = 0.0
    # Each step follows the one before at once, the GPU still busy, as in a serving loop: no synchronize and
    # no idle before it, so the host never sleeps between steps; it waits only for the tokens it reads.
    overlapped: bool = False


def steps_per_block(scenario: Scenario) -> int:
    """The steps that chunk a block's prompt (step_tokens - batch of its tokens each), then its decodes."""
    chunk_steps = -(-scenario.prompt_len // (scenario.step_tokens - scenario.batch))
    return chunk_steps + scenario.decode_steps


def steps_per_pass(scenario: Scenario) -> int:
    return scenario.prompts * steps_per_block(scenario)


def decode_len(scenario: Scenario) -> int:
    """Output tokens of a decoder: enough for the warm-up, the timed rounds, the phase-timed and profiled
    passes, and their slack."""
    return (scenario.rounds + 4) * steps_per_pass(scenario) + 64


FULL = Scenario(batch=64, adapters=8, prompts=8, prompt_len=2048, step_tokens=512, decode_steps=6, rounds=9)
# The CPU's slora-tiny-llama has a context of 2,048 tokens, which must hold the prompt and its output token.
FULL_CPU = FULL._replace(prompt_len=1920)
QUICK = Scenario(batch=4, adapters=2, prompts=2, prompt_len=96, step_tokens=32, decode_steps=3, rounds=2)


def context_needed(scenario: Scenario) -> int:
    """The longest sequence of a run: a decoder's prompt and outputs, or a chunked prompt and its output token."""
    return max(DECODE_PROMPT + decode_len(scenario), scenario.prompt_len + 1)


def check_fits(scenario: Scenario, setup: ModelSetup) -> None:
    """Refuses, before any engine is built, a scenario whose sequences overrun the model's context."""
    if context_needed(scenario) > setup.context:
        raise SystemExit(f"the scenario needs sequences of {context_needed(scenario)} tokens (--prompt-len "
                         f"{scenario.prompt_len} plus its output token, or the decoders' outputs); the model's "
                         f"context is {setup.context}")


def engine_kwargs(setup: ModelSetup, scenario: Scenario, extra: dict[str, Any]) -> dict[str, Any]:
    return {**model_kwargs(setup), "max_num_seqs": scenario.batch + scenario.prompts, "max_loras": 32,
            "max_lora_rank": 16, "max_num_batched_tokens": scenario.step_tokens, "seed": 42,
            "max_model_len": context_needed(scenario), **extra}


def build_llm(setup: ModelSetup, scenario: Scenario, extra: dict[str, Any], root: Path) -> tuple[Any, list]:
    """The engine, its adapters registered; and the decoders' adapter names (None: the base model)."""
    llm = new_llm(setup, engine_kwargs(setup, scenario, extra))
    paths = write_adapters(root / "adapters", setup, [16] * scenario.adapters, PROJECTIONS)
    names = [f"a{i}" for i in range(len(paths))]
    load_adapters(llm, list(zip(names, paths)))
    return llm, names or [None]


def add_requests(engine: Any, prefix: str, prompts: list[list[int]], max_tokens: int, adapters: list) -> None:
    from slora import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}-{i}", prompt, params, adapter=adapters[i % len(adapters)], stream=False)


def start_decoders(engine: Any, scenario: Scenario, adapters: list, vocab: int) -> None:
    """The decoding requests, stepped until every one has its prompt done (the next steps decode)."""
    prompts = make_prompts([Request(DECODE_PROMPT, 1, None, 0, 0.0)] * scenario.batch, vocab, seed=1)
    add_requests(engine, "decode", prompts, decode_len(scenario), adapters)
    for _ in range(-(-scenario.batch * DECODE_PROMPT // scenario.step_tokens) + 2):
        engine.step()


def one_pass(engine: Any, scenario: Scenario, adapters: list, vocab: int, seed: int, device: str,
             call: Callable[[Callable[[], object]], T]) -> dict[str, list[tuple[int, T]]]:
    """The pass's blocks: a new prompt chunked beside the decodes, then decode steps. `call(engine.step)` by
    step kind, each with its block."""
    prompts = make_prompts([Request(scenario.prompt_len, 1, None, 0, 0.0)] * scenario.prompts, vocab, seed)
    block_steps, steps = steps_per_block(scenario), itertools.count()
    step = after_idle(scenario.idle_ms, lambda: call(engine.step))

    def step_in_block() -> tuple[int, T]:
        block, offset = divmod(next(steps), block_steps)
        if offset == 0:
            add_requests(engine, f"chunk-{seed}-{block}", [prompts[block]], 1, adapters[:1])
        return block, step()
    return calls_by_kind(engine, steps_per_pass(scenario), device, step_in_block, idle_gpu=not scenario.overlapped)


def without_blocks(results: dict[str, list[tuple[int, T]]]) -> dict[str, list[T]]:
    return {kind: [value for _, value in values] for kind, values in results.items()}


def block_ratios(results: dict[str, list[tuple[int, "StepTime"]]]) -> list[float]:
    """Per block of a timed pass that has both kinds: its chunk steps' median seconds over its decode steps'."""
    by_block: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for kind, values in results.items():
        for block, step_time in values:
            by_block[block][kind].append(step_time.seconds)
    ratios = (_chunk_over_decode({kind: statistics.median(s) for kind, s in kinds.items()})
              for _, kinds in sorted(by_block.items()))
    return [ratio for ratio in ratios if ratio is not None]


@contextmanager
def host_work_only(vocab: int, max_rows: int) -> Iterator[None]:
    """The model's forward replaced by zero logits (zero_logits_forward), and torch on one thread, while the
    context is open. The sampler's argmax over those logits is the one torch op left on the CPU, and on more
    threads it wakes torch's thread pool, which after an idle host costs a chunk step far more than the
    argmax: a cost the host does not have when the GPU samples."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with zero_logits_forward(vocab, max_rows):
            yield
    finally:
        torch.set_num_threads(threads)


def zero_logits_forward(vocab: int, max_rows: int) -> contextlib.AbstractContextManager:
    """The model runner's eager forward returns zero logits `[sampled rows, vocab]` without running the model,
    while the context is open: the steps then time the host's own work alone. The rows are a view of one
    buffer, as a graph's logits are: a tensor allocated per step costs the CPU's allocator more in chunk steps
    than in decode steps, and that cost is not the engine's host work."""
    from slora.execution.model_runner import ModelRunner

    logits = torch.zeros(max_rows, vocab)                 # [max_rows, vocab]: greedy sampling only reads it

    def forward(runner: ModelRunner, host: Any, feed: Any = None) -> torch.Tensor:
        rows = len(host.sample_indices)
        assert rows <= max_rows, f"{rows} sampled rows, the zero logits hold {max_rows}"
        return logits[:rows]
    return mock.patch.object(ModelRunner, "forward", forward)


def after_idle(idle_ms: float, call: Callable[[], T]) -> Callable[[], T]:
    """`call`, run after the host sleeps `idle_ms` (not timed: `call` times itself)."""
    if idle_ms <= 0:
        return call

    def idle_then_call() -> T:
        time.sleep(idle_ms / 1e3)
        return call()
    return idle_then_call


class GcClock:
    """Seconds the garbage collector ran since the clock was made (gc.callbacks), while it is installed."""

    def __init__(self) -> None:
        self.seconds, self._started = 0.0, 0.0

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


# The step's waits for the GPU: every CUDA event's synchronize, which is the wait for the tokens of the step
# before (HostCopy.result) and, a few µs where the copy is long done, for a staging twin to be free again
# (StagedBuffers.begin); with async_scheduling off the tokens waited for are the step's own. A phase, but not
# host work (timed_step and host_phase_sum leave it out).
WAIT_PHASE = "wait_for_tokens"
# In an overlapped run, a step whose wait for the tokens of the step before was longer than this found the GPU
# still busy: the GPU, not the host, set its pace (an event already complete returns in a few µs on a hot host).
WAITED_S = 20e-6
# phase -> (module, class or None for a module's function, function) of the engine step's parts that a phase
# timer wraps.
Where = tuple[str, str | None, str]
PHASES: dict[str, Where] = {
    "schedule": ("slora.core.scheduler", "Scheduler", "schedule"),
    "move_pages": ("slora.execution.model_runner", "ModelRunner", "move_pages"),
    "build_inputs": ("slora.execution.model_runner", "ModelRunner", "inputs_for"),
    "stage_batch": ("slora.execution.step_batch", "StepBatch", "copy_into"),
    "stage_mixed_extras": ("slora.execution.mixed_graphs", "MixedGraphs", "_stage_extras"),
    "stage_send": ("slora.execution.staging", "StagedBatch", "send"),
    "graph_replay": ("torch.cuda", "CUDAGraph", "replay"),
    "eager_forward": ("slora.execution.model_runner", "ModelRunner", "forward"),
    "sample": ("slora.engine", "Engine", "_sample_step"),
    "take_sampled": ("slora.engine", "Engine", "_collect"),
    WAIT_PHASE: ("torch.cuda", "Event", "synchronize"),
}
# --fine-phases: the parts of scheduling and sampling that a chunk step does more of (its pages, their hashes,
# admissions), timed apart from the phases that call them. None of them runs outside engine.step() here: the
# prompt's hashing on arrival (Scheduler.add) would be charged to the next step, so it is not one of them. And
# the step's device work besides the staged send and the replay: the ids the step before sampled, fed into
# this step's input ids; the sampler's work on the device; then the sampled ids' copy to the host.
FINE_PHASES: dict[str, Where] = {
    "admit": ("slora.core.scheduler", "Scheduler", "_admit_waiting"),
    "allocate_kv_pages": ("slora.core.page_pool", "PageAllocator", "allocate_kv_pages"),
    "release_kv_pages": ("slora.core.page_pool", "PageAllocator", "release_kv_pages"),
    "on_computed": ("slora.core.scheduler", "Scheduler", "on_computed"),
    "register_hashes": ("slora.core.page_pool", "PageAllocator", "register_hashes"),
    "feed_tokens": ("slora.execution.step_batch", None, "feed_tokens"),
    "sample_on_device": ("slora.sampling.sampler", "Sampler", "on_device"),
    "copy_sampled": ("slora.execution.in_flight", "HostCopy", "__init__"),
}


class PhaseClock:
    """Seconds per phase of the calls made while it is installed, each phase's own: the time of the phases
    it calls is theirs."""

    def __init__(self, phases: dict[str, Where]) -> None:
        self.phases = phases                  # phase -> (module, class or None, function), as PHASES
        self.seconds: dict[str, float] = defaultdict(float)
        self._nested: list[float] = []        # per open phase call: seconds of the phase calls inside it

    def wrap(self, phase: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self._nested.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[phase] += elapsed - self._nested.pop()
                if self._nested:
                    self._nested[-1] += elapsed
        return timed

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last take."""
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds


@contextmanager
def phase_timers(clock: PhaseClock) -> Iterator[None]:
    """Every function of the clock's phases wrapped by its timer while the context is open; should a phase
    not be found, those wrapped before it are put back."""
    originals = []
    try:
        for phase, (module, owner, name) in clock.phases.items():
            imported = importlib.import_module(module)
            holder = imported if owner is None else getattr(imported, owner)
            original = inspect.getattr_static(holder, name)
            wrapped = clock.wrap(phase, getattr(holder, name))
            setattr(holder, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
            originals.append((holder, name, original))
        yield
    finally:
        for holder, name, original in originals:
            setattr(holder, name, original)


class StepTime(NamedTuple):
    seconds: float           # the call's own work: its wall time less its wait for the GPU
    gc_seconds: float        # garbage collection inside the call
    wait_seconds: float      # the call's waits for the GPU, the tokens of the step before's above all


def wait_clock() -> PhaseClock:
    """A clock of the step's waits for the GPU alone (WAIT_PHASE), for timed_step under phase_timers."""
    return PhaseClock({WAIT_PHASE: PHASES[WAIT_PHASE]})


def timed_step(waits: PhaseClock, call: Callable[[], object]) -> StepTime:
    """The call's host work, apart from the time it waited for the GPU as `waits` times it (on an idle GPU the
    event's check: a few µs on a hot host, tens after a sleep; in an overlapped loop, the rest of the step
    before's forward)."""
    waits.take()                                  # a wait before the call is not its own
    with GcClock() as clock:
        seconds = timed_call(call)
    waited = waits.take().get(WAIT_PHASE, 0.0)
    return StepTime(seconds - waited, clock.seconds, waited)


def phased_call(clock: PhaseClock, call: Callable[[], object]) -> dict[str, float]:
    """The seconds of each phase of the call, and of the rest of it ("other")."""
    seconds = timed_call(call)
    phases = clock.take()
    return {**phases, "other": seconds - sum(phases.values())}


def host_phase_sum(phase_ms: dict[str, float]) -> float:
    """A step's phases' ms without its wait for the GPU: its host work."""
    return sum(ms for phase, ms in phase_ms.items() if phase != WAIT_PHASE)


def phase_rows(phases: dict[str, list[dict[str, float]]], timed: list[str]) -> dict[str, dict[str, float]]:
    """Per step kind, the mean ms of each `timed` phase and of "other" over its steps (means, so that they add
    up to the step's wall time; host_phase_sum's, without the wait, to its host work)."""
    names = [*timed, "other"]
    return {kind: {name: 1e3 * statistics.fmean(step.get(name, 0.0) for step in steps) for name in names}
            for kind, steps in phases.items()}


def summary(times: dict[str, list[StepTime]], phases: dict[str, list[dict[str, float]]],
            profiles: dict[str, list], timed: list[str], overlapped: bool) -> dict[str, dict[str, Any]]:
    """kind_rows of the calls' host seconds, with the garbage collector's ms per step, the waits for the GPU
    (and in an overlapped run the share of steps that found it busy), and the `timed` phases beside them."""
    rows = kind_rows(_call_seconds(times), profiles, 30)
    by_phase = phase_rows(phases, timed)
    return {kind: {**rows[kind], "gc_ms_per_step": 1e3 * statistics.fmean(t.gc_seconds for t in values),
                   "wait_ms_median": 1e3 * statistics.median(t.wait_seconds for t in values),
                   "gpu_paced_share": gpu_paced_share(values) if overlapped else None,
                   "phase_mean_ms": by_phase.get(kind, {})}
            for kind, values in times.items()}


def gpu_paced_share(times: list[StepTime]) -> float:
    """The share of steps that waited for the tokens of the step before: the GPU was still busy when the host
    had done this step's work, so that work was hidden behind the forward before. Only in an overlapped run:
    on an idle GPU the wait is the event's check, which after an idle host takes tens of µs too."""
    return statistics.fmean(t.wait_seconds > WAITED_S for t in times)


class Passes(NamedTuple):
    """What the passes after the warm-up gave, by step kind."""
    rounds: list[dict[str, list[tuple[int, StepTime]]]]             # (block, its time)
    phases: dict[str, list[dict[str, float]]]
    profiles: dict[str, list]


def all_passes(engine: Any, scenario: Scenario, adapters: list, vocab: int, device: str, clock: PhaseClock) -> Passes:
    start_decoders(engine, scenario, adapters, vocab)
    one_pass(engine, scenario, adapters, vocab, 2, device, timed_call)       # warm-up: shapes, mixes
    waits = wait_clock()
    with phase_timers(waits):
        rounds = [one_pass(engine, scenario, adapters, vocab, 3 + i, device, lambda call: timed_step(waits, call))
                  for i in range(scenario.rounds)]
    seed = 3 + scenario.rounds
    with phase_timers(clock):
        phases = one_pass(engine, scenario, adapters, vocab, seed, device, lambda call: phased_call(clock, call))
    profiles = one_pass(engine, scenario, adapters, vocab, seed + 1, device, profiled_call)
    return Passes(rounds, without_blocks(phases), without_blocks(profiles))


def run(scenario: Scenario, device: str, extra: dict[str, Any], host_only: bool = False,
        fine_phases: bool = False) -> dict[str, Any]:
    clock = PhaseClock({**PHASES, **FINE_PHASES} if fine_phases else PHASES)
    with tempfile.TemporaryDirectory(prefix="slora-step-host-") as tmp:
        setup = prepare_model(device, Path(tmp))
        check_fits(scenario, setup)
        llm, adapters = build_llm(setup, scenario, extra, Path(tmp))
        with host_work_only(setup.vocab_size, scenario.step_tokens) if host_only else contextlib.nullcontext():
            passes = all_passes(llm.engine, scenario, adapters, setup.vocab_size, device, clock)
    by_kind = summary(pooled(passes.rounds), passes.phases, passes.profiles, list(clock.phases),
                      scenario.overlapped)
    medians = {kind: row["median_ms"] for kind, row in by_kind.items()}
    phase_means = {kind: host_phase_sum(row["phase_mean_ms"]) for kind, row in by_kind.items()}
    blocks = [ratio for results in passes.rounds for ratio in block_ratios(results)]
    return {"benchmark": "step_host", "device": device, "model": setup.description, "host_only": host_only,
            "scenario": scenario._asdict(), "engine": engine_kwargs(setup, scenario, extra),
            "method": f"each engine.step() timed {start_of_step(scenario)}, less its wait for the GPU "
                      "(wait_ms_median), and charged to the kind of step it launched, "
                      "over `rounds` passes of `prompts` blocks (medians pooled, per round and per block); then "
                      "a pass with the phases_timed timed (phase_mean_ms), and one under cProfile (top_own_time)",
            "phases_timed": list(clock.phases), "host_ms_by_kind": by_kind,
            "chunk_over_decode_median": _chunk_over_decode(medians),
            "chunk_over_decode_median_by_round": [_chunk_over_decode(round_medians(r)) for r in passes.rounds],
            # Per block, its chunk steps' median over its decode steps': the two ran next to each other.
            "chunk_over_decode_by_block": blocks,
            "chunk_over_decode_block_median": statistics.median(blocks) if blocks else None,
            "chunk_over_decode_phase_pass_mean": _chunk_over_decode(phase_means)}


def start_of_step(scenario: Scenario) -> str:
    return "right after the one before" if scenario.overlapped else "from an idle GPU"


def pooled(rounds: list[dict[str, list[tuple[int, T]]]]) -> dict[str, list[T]]:
    """The timed rounds' results by step kind, in one list per kind."""
    kinds: dict[str, list[T]] = defaultdict(list)
    for results in rounds:
        for kind, values in without_blocks(results).items():
            kinds[kind] += values
    return dict(kinds)


def _call_seconds(times: dict[str, list[StepTime]]) -> dict[str, list[float]]:
    """The calls' host seconds by step kind."""
    return {kind: [t.seconds for t in values] for kind, values in times.items()}


def round_medians(results: dict[str, list[tuple[int, StepTime]]]) -> dict[str, float]:
    """Median ms of each step kind in one timed round (kind_rows', without profiles)."""
    return {kind: row["median_ms"]
            for kind, row in kind_rows(_call_seconds(without_blocks(results)), {}, 0).items()}


def _chunk_over_decode(by_kind: dict[str, float]) -> float | None:
    """A chunk step's figure over a decode step's (None without both kinds). Every chunk step of the scenario
    is of one kind: graphed on CUDA (step_tokens is within the mixed-step graphs), eager on the CPU."""
    chunk = [value for kind, value in by_kind.items() if kind.startswith("mixed")]
    assert len(chunk) <= 1, f"chunk steps of several kinds: {sorted(by_kind)}"
    if not chunk or "decode" not in by_kind:
        return None
    return chunk[0] / by_kind["decode"]


# ---- --host-speed: the host's speed on the kinds of work a step does, to compare machines ---------------------
CGROUP = Path("/sys/fs/cgroup")


def _fill_dict() -> Callable[[], object]:
    stored: dict[int, int] = {}      # one per run, refilled by every call

    def fill() -> None:
        for i in range(1000):
            stored[i] = i
    return fill


def _list_comprehension() -> Callable[[], object]:
    rows = list(range(64))
    return lambda: [r * 2 + 1 for r in rows]


def _array_from_list() -> Callable[[], object]:
    rows = list(range(64))
    return lambda: np.array(rows)


def _slot_arithmetic() -> Callable[[], object]:
    positions, table = np.arange(512), np.arange(64)    # [tokens], [pages]: a row's block table
    return lambda: table[positions // 16] * 16 + positions % 16


def _torch_add() -> Callable[[], object]:
    x = torch.zeros(512)
    return lambda: x.add_(1)


# Each makes, per run, the unit's call (best_us_per_call's `make`).
HOST_UNITS: dict[str, Callable[[], Callable[[], object]]] = {
    "python_dict_1000": _fill_dict, "python_list_comp_64": _list_comprehension,
    "numpy_array_from_list_64": _array_from_list, "numpy_slots_512": _slot_arithmetic,
    "torch_cpu_add_512": _torch_add,
}


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpuinfo(field: str) -> str | None:
    """The first core's `field` in /proc/cpuinfo ("model name", "cpu MHz"; None where it has none)."""
    for line in (_read_text(Path("/proc/cpuinfo")) or "").splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return None


def throttling(cgroup: Path = CGROUP) -> dict[str, int]:
    """The cgroup's CPU throttling counters (cgroup v2's cpu.stat), empty where there are none."""
    fields = (line.split() for line in (_read_text(cgroup / "cpu.stat") or "").splitlines())
    return {name: int(value) for name, value in fields if name.startswith(("nr_throttled", "throttled_"))}


def host_speed(timing: CallTiming) -> dict[str, Any]:
    """Each of HOST_UNITS in µs a call (the best of `timing.repeats` runs of `timing.iterations` calls), the host
    that ran them, and the cgroup's throttling meanwhile."""
    before = throttling()
    units = {name: best_us_per_call(make, timing) for name, make in HOST_UNITS.items()}
    after = throttling()
    host = {"python": sys.version, "python_config": sysconfig.get_config_var("CONFIG_ARGS"),
            "cpu_model": _cpuinfo("model name"), "cpu_mhz": _cpuinfo("cpu MHz"), "cpu_count": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "numpy": np.__version__, "torch": torch.__version__, "cgroup_cpu_max": _read_text(CGROUP / "cpu.max")}
    return {"units_us": units, "iterations": timing.iterations, "repeats": timing.repeats, "host": host,
            "throttled_during": {k: after[k] - before.get(k, 0) for k in after}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--batch", type=int, default=None, help="decoding requests (default 64; quick 4)")
    parser.add_argument("--adapters", type=int, default=None, help="their adapters (default 8; quick 2; 0: none)")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="tokens of a chunked prompt (default 2048, 1920 on the CPU; quick 96; under the "
                             "model's context)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--idle-ms", type=float, default=None,
                       help="ms the host sleeps before each step, the GPU idle (default 0)")
    start.add_argument("--overlapped", action="store_true",
                       help="each step right after the one before, the GPU still busy, as in a serving loop "
                            "(no synchronize, no idle)")
    parser.add_argument("--host-only", action="store_true",
                        help="CPU only: zero logits in place of the model's forward, the host's work alone")
    parser.add_argument("--fine-phases", action="store_true",
                        help="also time the chunk's parts of scheduling and sampling (FINE_PHASES) as phases")
    parser.add_argument("--host-speed", action="store_true",
                        help="also time HOST_UNITS alone and record the host, to compare machines")
    add_engine_arg(parser, "async_scheduling=false")
    parser.add_argument("--out", default=None, help="JSON file (default: results/<cpu|h100|h200>/step_host.json)")
    return parser.parse_args(argv)


def scenario_of(args: argparse.Namespace, device: str) -> Scenario:
    base = QUICK if args.quick else FULL_CPU if device == "cpu" else FULL
    given = (("batch", args.batch), ("adapters", args.adapters), ("prompt_len", args.prompt_len),
             ("idle_ms", args.idle_ms))
    changes = {k: v for k, v in given if v is not None}
    scenario = base._replace(**changes, overlapped=args.overlapped)
    if not 0 < scenario.batch < scenario.step_tokens or scenario.adapters < 0 or scenario.prompt_len < 1 \
            or scenario.idle_ms < 0:
        raise SystemExit(f"--batch must be in 1..{scenario.step_tokens - 1}, --adapters >= 0, --prompt-len >= 1, "
                         "--idle-ms >= 0")
    return scenario


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.host_only and device != "cpu":
        raise SystemExit("--host-only runs on the CPU: on CUDA the steps replay graphs, not the eager forward")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("slora").setLevel(logging.WARNING)
    data = run(scenario_of(args, device), device, dict(args.engine_arg), args.host_only, args.fine_phases)
    if args.host_speed:
        data["host_speed"] = host_speed(CallTiming(20, 1) if args.quick else CallTiming(2000, 5))
    write_json(Path(args.out) if args.out else default_out("step_host", device), data)
    print_table([{"step": kind, "steps": row["steps"], "median_ms": row["median_ms"], "mean_ms": row["mean_ms"],
                  "wait_ms_median": row["wait_ms_median"]} for kind, row in data["host_ms_by_kind"].items()])
    if args.host_speed:
        print_table([{"unit": name, "us": us} for name, us in data["host_speed"]["units_us"].items()])
    for kind, row in data["host_ms_by_kind"].items():
        logger.info("%-32s %4d steps, median %.3f ms, mean %.3f ms, gc %.3f ms, wait %.3f ms, GPU-paced %s",
                    kind, row["steps"], row["median_ms"], row["mean_ms"], row["gc_ms_per_step"],
                    row["wait_ms_median"], row["gpu_paced_share"])
        logger.info("    phases (mean ms): %s", ", ".join(f"{k} {v:.3f}" for k, v in row["phase_mean_ms"].items()))
    logger.info("chunk / decode: median %s (by round %s), block median %s, phase pass mean %s",
                data["chunk_over_decode_median"], data["chunk_over_decode_median_by_round"],
                data["chunk_over_decode_block_median"], data["chunk_over_decode_phase_pass_mean"])


if __name__ == "__main__":
    main()
