"""The host's own work per engine step: decode steps, and chunked-prefill steps beside the same decodes
(issue 22: a chunked-prefill step with decodes beside it must cost the host no more than a decode step).

One engine (the Llama-3-8B shape with random bf16 weights on CUDA, slora-tiny-llama on the CPU), CUDA graphs
as by default, and a step budget of --step-tokens (512: every chunk step fits a mixed-step graph). --batch
requests decode (16-token prompts, long outputs, greedy, ignore_eos), on --adapters rank-16 adapters round
robin (0: the base model). Then --prompts requests of --prompt-len tokens and one output token each arrive,
on the decoders' first adapter, and the steps that chunk them hold every decode beside their chunk; once
they are done the steps are decode steps again. Each `engine.step()` starts on an idle GPU and is charged to
the kind of step it launched (engine_throughput.calls_by_kind). A second pass of new prompts runs with a
timer around each of the engine's phases (PHASES: each timed without the phases it calls), whose means add
up to the step's; a third runs under cProfile, whose functions by own time say where each phase's time goes.

    python benchmarks/step_host.py [--quick] [--device cpu|cuda] [--batch 64] [--adapters 0|8] [--prompt-len N]
                                   [--idle-ms MS] [--engine-arg KEY=VALUE ...] [--out FILE]
"""
import argparse
import gc
import importlib
import inspect
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from common import PROJECTIONS, RESULTS, ModelSetup, make_prompts, prepare_model, write_adapters, write_json
from engine_throughput import (
    calls_by_kind,
    kind_rows,
    load_adapters,
    model_kwargs,
    new_llm,
    parse_engine_arg,
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
    prompts: int            # chunked prompts per pass
    prompt_len: int
    step_tokens: int        # the engine's max_num_batched_tokens
    decode_steps: int       # decode steps timed after each pass's prompts are done
    rounds: int             # timed passes: each gives its own chunk / decode ratio
    # ms the host sleeps after the GPU is idle and before each step: both kinds then start from a like idle
    # host, not from a wait as long as the step before's GPU time (0: none).
    idle_ms: float = 0.0


def steps_per_pass(scenario: Scenario) -> int:
    """The steps that chunk one pass's prompts (step_tokens - batch of their tokens each), then its decodes."""
    chunk_steps = -(-scenario.prompts * scenario.prompt_len // (scenario.step_tokens - scenario.batch))
    return chunk_steps + scenario.decode_steps


def decode_len(scenario: Scenario) -> int:
    """Output tokens of a decoder: enough for the warm-up, the timed rounds, the phase-timed and profiled
    passes, and their slack."""
    return (scenario.rounds + 4) * steps_per_pass(scenario) + 64


FULL = Scenario(batch=64, adapters=8, prompts=8, prompt_len=2048, step_tokens=512, decode_steps=48, rounds=9)
QUICK = Scenario(batch=4, adapters=2, prompts=2, prompt_len=96, step_tokens=32, decode_steps=6, rounds=2)


def engine_kwargs(setup: ModelSetup, scenario: Scenario, extra: dict[str, Any]) -> dict[str, Any]:
    return {**model_kwargs(setup), "max_num_seqs": scenario.batch + scenario.prompts, "max_loras": 32,
            "max_lora_rank": 16, "max_num_batched_tokens": scenario.step_tokens, "seed": 42,
            "max_model_len": max(DECODE_PROMPT + decode_len(scenario), scenario.prompt_len + 1), **extra}


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
             call: Callable[[Callable[[], object]], Any]) -> dict[str, list]:
    """New prompts chunked beside the decodes, then decode steps: `call(engine.step)` by step kind."""
    prompts = make_prompts([Request(scenario.prompt_len, 1, None, 0, 0.0)] * scenario.prompts, vocab, seed)
    add_requests(engine, f"chunk-{seed}", prompts, 1, adapters[:1])
    step = after_idle(scenario.idle_ms, lambda: call(engine.step))
    return calls_by_kind(engine, steps_per_pass(scenario), device, step)


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


def timed_with_gc(call: Callable[[], object]) -> tuple[float, float]:
    """(seconds of the call, seconds of garbage collection inside it)."""
    with GcClock() as clock:
        seconds = timed_call(call)
    return seconds, clock.seconds


# phase -> (module, class, function) of the engine step's parts that a phase timer wraps.
PHASES = {
    "schedule": ("slora.scheduler", "Scheduler", "schedule"),
    "move_pages": ("slora.model_runner", "ModelRunner", "move_pages"),
    "build_inputs": ("slora.model_runner", "ModelRunner", "inputs_for"),
    "stage_batch": ("slora.step_batch", "StepBatch", "copy_into"),
    "stage_mixed_extras": ("slora.mixed_graphs", "MixedGraphs", "_stage_extras"),
    "stage_send": ("slora.staging", "StagedBatch", "send"),
    "graph_replay": ("torch.cuda", "CUDAGraph", "replay"),
    "eager_forward": ("slora.model_runner", "ModelRunner", "forward"),
    "sample": ("slora.engine", "Engine", "_sample_step"),
    "take_sampled": ("slora.engine", "Engine", "_take_sampled"),
}


class PhaseClock:
    """Seconds per phase of the calls made while it is installed, each phase's own: the time of the phases
    it calls is theirs."""

    def __init__(self) -> None:
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
    """Every PHASES function wrapped by the clock's timer while the context is open."""
    originals = []
    for phase, (module, owner, name) in PHASES.items():
        cls = getattr(importlib.import_module(module), owner)
        original = inspect.getattr_static(cls, name)
        wrapped = clock.wrap(phase, getattr(cls, name))
        setattr(cls, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
        originals.append((cls, name, original))
    try:
        yield
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)


def phased_call(clock: PhaseClock, call: Callable[[], object]) -> dict[str, float]:
    """The seconds of each phase of the call, and of the rest of it ("other")."""
    seconds = timed_call(call)
    phases = clock.take()
    return {**phases, "other": seconds - sum(phases.values())}


def phase_rows(phases: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per step kind, the mean ms of each phase over its steps (means, so that they add up to the step's)."""
    names = [*PHASES, "other"]
    return {kind: {name: 1e3 * statistics.fmean(step.get(name, 0.0) for step in steps) for name in names}
            for kind, steps in phases.items()}


def summary(times: dict[str, list[tuple[float, float]]], phases: dict[str, list[dict[str, float]]],
            profiles: dict[str, list]) -> dict[str, dict[str, Any]]:
    """kind_rows of the calls' seconds, with the garbage collector's ms per step and the phases beside them."""
    rows = kind_rows(_call_seconds(times), profiles, 30)
    by_phase = phase_rows(phases)
    return {kind: {**rows[kind], "gc_ms_per_step": 1e3 * statistics.fmean(g for _, g in values),
                   "phase_mean_ms": by_phase.get(kind, {})}
            for kind, values in times.items()}


def run(scenario: Scenario, device: str, extra: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="slora-step-host-") as tmp:
        setup = prepare_model(device, Path(tmp))
        llm, adapters = build_llm(setup, scenario, extra, Path(tmp))
        engine, vocab = llm.engine, setup.vocab_size
        start_decoders(engine, scenario, adapters, vocab)
        one_pass(engine, scenario, adapters, vocab, 2, device, timed_call)       # warm-up: shapes, mixes
        rounds = [one_pass(engine, scenario, adapters, vocab, 3 + i, device, timed_with_gc)
                  for i in range(scenario.rounds)]
        seed = 3 + scenario.rounds
        clock = PhaseClock()
        with phase_timers(clock):
            phases = one_pass(engine, scenario, adapters, vocab, seed, device, lambda call: phased_call(clock, call))
        profiles = one_pass(engine, scenario, adapters, vocab, seed + 1, device, profiled_call)
        by_kind = summary(pooled(rounds), phases, profiles)
        medians = {kind: row["median_ms"] for kind, row in by_kind.items()}
        phase_means = {kind: sum(row["phase_mean_ms"].values()) for kind, row in by_kind.items()}
    return {"benchmark": "step_host", "device": device, "model": setup.description,
            "scenario": scenario._asdict(), "engine": engine_kwargs(setup, scenario, extra),
            "method": "each engine.step() timed from an idle GPU and charged to the kind of step it launched, "
                      "over `rounds` passes (medians pooled, and per round); then a pass with PHASES timed "
                      "(phase_mean_ms), and one under cProfile (top_own_time)",
            "host_ms_by_kind": by_kind, "graphed_mixed_over_decode_median": _mixed_over_decode(medians),
            "graphed_mixed_over_decode_median_by_round": [_mixed_over_decode(round_medians(r)) for r in rounds],
            # The same ratio from the phase-timed pass (mean ms, its phases summed): the host's speed drifts
            # between passes, and each pass's ratio compares steps run next to each other.
            "graphed_mixed_over_decode_phase_pass_mean": _mixed_over_decode(phase_means)}


def pooled(rounds: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """The timed rounds' results by step kind, in one list per kind."""
    kinds: dict[str, list[Any]] = defaultdict(list)
    for results in rounds:
        for kind, values in results.items():
            kinds[kind] += values
    return dict(kinds)


def _call_seconds(times: dict[str, list[tuple[float, float]]]) -> dict[str, list[float]]:
    """The calls' seconds by step kind, without their garbage collector's."""
    return {kind: [t for t, _ in values] for kind, values in times.items()}


def round_medians(results: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Median ms of each step kind in one timed round (kind_rows', without profiles)."""
    return {kind: row["median_ms"] for kind, row in kind_rows(_call_seconds(results), {}, 0).items()}


def _mixed_over_decode(ms_by_kind: dict[str, float]) -> float | None:
    """A graphed chunk step's ms over a decode step's (None without both kinds)."""
    graphed = [ms for kind, ms in ms_by_kind.items() if "graphed" in kind]
    if not graphed or "decode" not in ms_by_kind:
        return None
    return graphed[0] / ms_by_kind["decode"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--batch", type=int, default=None, help="decoding requests (default 64; quick 4)")
    parser.add_argument("--adapters", type=int, default=None, help="their adapters (default 8; quick 2; 0: none)")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="tokens of a chunked prompt (default 2048; quick 96; under the model's context)")
    parser.add_argument("--idle-ms", type=float, default=None,
                        help="ms the host sleeps before each step, the GPU idle (default 0)")
    parser.add_argument("--engine-arg", type=parse_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                        help="an extra LLM keyword, e.g. async_scheduling=false")
    parser.add_argument("--out", default=None, help="JSON file (default: results/step_host_<device>.json)")
    return parser.parse_args(argv)


def scenario_of(args: argparse.Namespace) -> Scenario:
    base = QUICK if args.quick else FULL
    given = (("batch", args.batch), ("adapters", args.adapters), ("prompt_len", args.prompt_len),
             ("idle_ms", args.idle_ms))
    changes = {k: v for k, v in given if v is not None}
    scenario = base._replace(**changes)
    if not 0 < scenario.batch < scenario.step_tokens or scenario.adapters < 0 or scenario.prompt_len < 1 \
            or scenario.idle_ms < 0:
        raise SystemExit(f"--batch must be in 1..{scenario.step_tokens - 1}, --adapters >= 0, --prompt-len >= 1, "
                         "--idle-ms >= 0")
    return scenario


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("slora").setLevel(logging.WARNING)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    data = run(scenario_of(args), device, dict(args.engine_arg))
    out = Path(args.out or RESULTS / f"step_host_{'cpu' if device == 'cpu' else 'gpu'}.json")
    write_json(out, data)
    for kind, row in data["host_ms_by_kind"].items():
        logger.info("%-32s %4d steps, median %.3f ms, mean %.3f ms, gc %.3f ms", kind, row["steps"],
                    row["median_ms"], row["mean_ms"], row["gc_ms_per_step"])
        logger.info("    phases (mean ms): %s", ", ".join(f"{k} {v:.3f}" for k, v in row["phase_mean_ms"].items()))
    logger.info("graphed mixed / decode: median %s (by round %s), phase pass mean %s",
                data["graphed_mixed_over_decode_median"], data["graphed_mixed_over_decode_median_by_round"],
                data["graphed_mixed_over_decode_phase_pass_mean"])


if __name__ == "__main__":
    main()
