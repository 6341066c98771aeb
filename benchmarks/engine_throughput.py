"""Offline throughput of the engine on issue 22's six workloads, against the vLLM 0.26.0 figures measured on
one H200 (the GPU machine cannot install vLLM, so the reference is the issue's table, kept here).

Method, as the vLLM run was made: a Llama-3-8B-shaped model with random bf16 weights (`load_format="dummy"`),
PEFT adapter folders with random weights, every request of a workload submitted at once through the offline
API (`LLM.generate`), greedy, `ignore_eos`, fixed output lengths; engine settings max_num_seqs 256, max_loras
32, max_lora_rank 16. One engine serves all workloads; each workload's prompts are random token ids from a
seed of its own (timed and warm-up prompts apart), so no run hits another's prefix cache. Before each timed
run a warm-up (the workload's first requests, a few tokens each, other prompts) brings its shapes, kernels
and adapters in; it is not counted.

    decode_base          256 x (16 prompt -> 512 out), no adapter
    decode_32_adapters   the same, 32 distinct rank-16 adapters on all 7 projections, round robin
    prefill              256 x (1,024 prompt -> 1 out), no adapter (req/s is the figure)
    mixed_base           256 x (512 -> 128), no adapter
    mixed_32_adapters    256 x (512 -> 128), 32 rank-16 adapters on all 7 projections, round robin
    slora_trace          600 requests of `workloads.slora_trace`, lengths uniform in [8, 512] in and out, 100
                         rank-8 q/k/v/o adapters, power-law popularity (--alpha, default 0.8: S-LoRA's own
                         power-law setting of its H100 runs; alpha 1 is uniform)

`vs_vllm` (gen tok/s over vLLM's) is given only for full-size runs on CUDA. --quick: slora-tiny-llama on the
CPU (or the 8B shape on CUDA), a few short requests per workload and 4 / 8 adapters instead of 32 / 100.

    python benchmarks/engine_throughput.py [--quick] [--device cpu|cuda] [--workloads decode_base,prefill]
                                           [--alpha A] [--engine-arg KEY=VALUE ...] [--out FILE]
"""
import argparse
import cProfile
import logging
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import torch
from common import (
    ATTENTION,
    LOAD_THREADS,
    PROJECTIONS,
    RESULTS,
    SLORA_LENGTHS,
    ModelSetup,
    add_engine_arg,
    make_prompts,
    prepare_model,
    print_table,
    write_adapters,
    write_json,
)
from workloads import Request, slora_trace

logger = logging.getLogger("benchmarks.engine_throughput")
T = TypeVar("T")
SEED = 42
# S-LoRA's power-law exponent of its H100 breakdown suite (benchmarks/exp_suite.py); np.random.power(1) is
# uniform, smaller values put more requests on the low adapter indices.
DEFAULT_ALPHA = 0.8
# The engine settings of the vLLM run (max_loras, max_lora_rank; max_num_seqs as vLLM was given it).
ENGINE_SETTINGS = MappingProxyType({"max_num_seqs": 256, "max_loras": 32, "max_lora_rank": 16})


# ---- the workloads ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterSet:
    """`count` random PEFT adapters of one rank on one set of modules, named `{name}-{i}`, adapter i written
    from seed `seed + i`."""
    name: str
    count: int
    rank: int
    targets: tuple[str, ...]
    seed: int

    def adapter_name(self, index: int) -> str:
        return f"{self.name}-{index}"


@dataclass(frozen=True)
class Sizes:
    """The workloads' sizes: the issue's (FULL), or small ones for CI (QUICK)."""
    requests: int
    decode: tuple[int, int]            # prompt, output
    prefill_prompt: int
    mixed: tuple[int, int]
    many_adapters: int                 # the "32 adapters" rows
    trace_requests: int
    trace_lengths: tuple[int, int]
    trace_adapters: int
    warm_up_requests: int
    warm_up_tokens: int


FULL = Sizes(requests=256, decode=(16, 512), prefill_prompt=1024, mixed=(512, 128), many_adapters=32,
             trace_requests=600, trace_lengths=SLORA_LENGTHS, trace_adapters=100, warm_up_requests=32,
             warm_up_tokens=8)
QUICK = Sizes(requests=8, decode=(16, 16), prefill_prompt=96, mixed=(48, 8), many_adapters=4, trace_requests=12,
              trace_lengths=(8, 16), trace_adapters=8, warm_up_requests=4, warm_up_tokens=2)


@dataclass(frozen=True)
class VllmFigure:
    """vLLM 0.26.0's figure for a workload on the H200 (issue 22's table)."""
    gen_tok_s: float
    req_s: float | None = None          # given for prefill, whose figure is requests/s
    lora_off_gen_tok_s: float | None = None    # base rows: the same run with LoRA support off


# Prefill's 42 req/s of one output token each is 42 generated tokens/s.
VLLM = MappingProxyType({
    "decode_base": VllmFigure(22243, lora_off_gen_tok_s=22319),
    "decode_32_adapters": VllmFigure(9329),
    "prefill": VllmFigure(42, req_s=42),
    "mixed_base": VllmFigure(6705, lora_off_gen_tok_s=6777),
    "mixed_32_adapters": VllmFigure(3825),
    "slora_trace": VllmFigure(3736),
})
WORKLOADS = tuple(VLLM)
# The workloads of equal requests: their shape (decode, prefill or mixed), and whether they use the 32 adapters.
FIXED_WORKLOADS = MappingProxyType({"decode_base": ("decode", False), "decode_32_adapters": ("decode", True),
                                    "prefill": ("prefill", False), "mixed_base": ("mixed", False),
                                    "mixed_32_adapters": ("mixed", True)})


@dataclass(frozen=True)
class Workload:
    name: str
    trace: list[Request]                # prompt and output length, adapter index of each request
    adapters: AdapterSet | None
    output_len: int | None              # fixed output length, None for the trace's uniform lengths

    def adapter_names(self) -> list[str | None]:
        if self.adapters is None:
            return [None] * len(self.trace)
        return [self.adapters.adapter_name(r.adapter) for r in self.trace]


def adapter_sets(sizes: Sizes) -> dict[str, AdapterSet]:
    return {"all7": AdapterSet("r16-all7", sizes.many_adapters, 16, PROJECTIONS, SEED),
            "qkvo": AdapterSet("r8-qkvo", sizes.trace_adapters, 8, ATTENTION, SEED + 1000)}


def fixed_trace(requests: int, prompt_len: int, output_len: int, adapters: AdapterSet | None) -> list[Request]:
    """`requests` equal requests, on the adapters round robin (or none)."""
    return [Request(prompt_len, output_len, None if adapters is None else i % adapters.count,
                    0 if adapters is None else adapters.rank, 0.0) for i in range(requests)]


def build_workload(name: str, sizes: Sizes, alpha: float) -> Workload:
    sets = adapter_sets(sizes)
    if name == "slora_trace":
        qkvo = sets["qkvo"]
        # Offline: the trace's arrival times are drawn (S-LoRA's draw order) but every request is sent at once.
        trace = slora_trace(sizes.trace_requests, qkvo.count, rate=1.0, alpha=alpha,
                            length_range=sizes.trace_lengths, seed=SEED)
        return Workload(name, trace, qkvo, None)
    shape, on_adapters = FIXED_WORKLOADS[name]
    prompt, output = {"decode": sizes.decode, "prefill": (sizes.prefill_prompt, 1), "mixed": sizes.mixed}[shape]
    adapters = sets["all7"] if on_adapters else None
    return Workload(name, fixed_trace(sizes.requests, prompt, output, adapters), adapters, output)


def max_model_len(sizes: Sizes) -> int:
    """The longest request of all six workloads (not only those picked: the engine stays the same)."""
    return max(sum(sizes.decode), sizes.prefill_prompt + 1, sum(sizes.mixed), 2 * sizes.trace_lengths[1])


# ---- the engine -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    device: str
    quick: bool
    workloads: tuple[str, ...]
    alpha: float
    engine_args: dict[str, Any] = field(default_factory=dict)
    # Also profile each workload (profile_workload): (steps skipped, steps per window), None: no profile.
    profile: tuple[int, int] | None = None

    @property
    def sizes(self) -> Sizes:
        return QUICK if self.quick else FULL

    @property
    def full_size_cuda(self) -> bool:
        return self.device != "cpu" and not self.quick


def model_kwargs(setup: ModelSetup) -> dict[str, Any]:
    """The LLM keywords that serve `setup`'s model: its device, and random weights for the 8B shape."""
    return {"device": setup.device, **({"load_format": "dummy"} if setup.dummy else {})}


def engine_kwargs(setup: ModelSetup, settings: Settings) -> dict[str, Any]:
    return {**model_kwargs(setup), **ENGINE_SETTINGS, "max_model_len": max_model_len(settings.sizes),
            "seed": SEED, **settings.engine_args}


def new_llm(setup: ModelSetup, kwargs: dict[str, Any]) -> Any:
    """An LLM over `setup`'s model (its folder for the 8B shape, slora-tiny-llama on the CPU)."""
    from slora import LLM
    from slora.models.builtin import TINY_MODEL

    return LLM(str(setup.folder) if setup.dummy else TINY_MODEL, **kwargs)


def build_engine(setup: ModelSetup, settings: Settings) -> Any:
    return new_llm(setup, engine_kwargs(setup, settings))


def load_adapters(llm: Any, named_paths: list[tuple[str, Path]]) -> float:
    """Register the adapters: read and packed on a thread pool, registered in order on this thread, a window
    at a time (prepared adapters are held pinned on CUDA until registered). Returns the seconds taken."""
    start = time.perf_counter()
    adapters = llm.engine.adapters
    window = 4 * LOAD_THREADS
    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        for first in range(0, len(named_paths), window):
            chunk = named_paths[first:first + window]
            for (name, _), prepared in zip(chunk, pool.map(lambda item: adapters.prepare(item[1]), chunk)):
                adapters.register(name, prepared)
    return time.perf_counter() - start


def write_adapter_sets(root: Path, setup: ModelSetup, sets: list[AdapterSet]) -> list[tuple[str, Path]]:
    """The PEFT folders of each set: (adapter name, folder)."""
    named = []
    for adapter_set in sets:
        paths = write_adapters(root / adapter_set.name, setup, [adapter_set.rank] * adapter_set.count,
                               adapter_set.targets, seed=adapter_set.seed)
        named += [(adapter_set.adapter_name(i), path) for i, path in enumerate(paths)]
    return named


# ---- one workload -----------------------------------------------------------------------------------------
def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def prompt_seed(name: str, warm_up: bool) -> int:
    # By the workload's place in the full list, so that picking some workloads keeps every one's prompts.
    return SEED * 100_000 + 100 * WORKLOADS.index(name) + int(warm_up)


def generate_all(llm: Any, prompts: list[list[int]], lengths: list[int], names: list[str | None]) -> list[Any]:
    from slora import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    return llm.generate(prompts, params, adapters=names)


def warm_up(llm: Any, load: Workload, sizes: Sizes, vocab_size: int) -> float:
    """The workload's first requests, a few tokens each, on prompts of their own. Returns its seconds."""
    head = load.trace[:sizes.warm_up_requests]
    start = time.perf_counter()
    generate_all(llm, make_prompts(head, vocab_size, prompt_seed(load.name, True)),
                 [min(r.output_len, sizes.warm_up_tokens) for r in head], load.adapter_names()[:len(head)])
    return time.perf_counter() - start


def run_workload(llm: Any, load: Workload, settings: Settings, vocab_size: int) -> dict[str, Any]:
    from slora.core.step_stats import StepStats

    prompts = make_prompts(load.trace, vocab_size, prompt_seed(load.name, False))
    warm_s = warm_up(llm, load, settings.sizes, vocab_size)
    llm.engine.step_stats = StepStats()
    synchronize(settings.device)
    start = time.perf_counter()
    outputs = generate_all(llm, prompts, [r.output_len for r in load.trace], load.adapter_names())
    synchronize(settings.device)
    wall = time.perf_counter() - start
    for request, output in zip(load.trace, outputs):
        produced = len(output.outputs[0].token_ids)
        if produced != request.output_len:
            raise RuntimeError(f"{load.name}: {produced} tokens for a request of {request.output_len}")
    return result_row(load, settings, wall, warm_s, llm.engine.step_stats.as_dict())


PROFILE_WINDOWS = (16, 16)           # steps skipped to reach the steady state, then steps per window
QUICK_PROFILE_WINDOWS = (2, 4)


def profile_workload(llm: Any, load: Workload, settings: Settings, vocab_size: int) -> dict[str, Any]:
    """Where a workload's steady-state step spends its time: the workload submitted again (prompts of its
    own), the first steps skipped, then three windows of equal steps: timed plainly (wall per step), under
    torch.profiler (the GPU's busy time per step: kernels and copies), and under cProfile (the host's
    functions by cumulative time per step). Busy time below the wall time is the GPU waiting for the host."""
    from slora import SamplingParams

    assert settings.profile is not None, "profile_workload runs with --profile"
    engine, (skip, window) = llm.engine, settings.profile
    prompts = make_prompts(load.trace, vocab_size, prompt_seed(load.name, True) + 50)
    for i, (prompt, request, name) in enumerate(zip(prompts, load.trace, load.adapter_names())):
        params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
        engine.add_request(f"profile-{i}", prompt, params, adapter=name, stream=False)   # as LLM.generate
    for _ in range(skip):
        engine.step()
    wall = timed_window(engine.step, window, settings.device)
    kernels = gpu_kernels_per_step(engine.step, window) if settings.device != "cpu" else []
    host = host_profile(engine.step, window)
    own = host_ms_by_kind(engine, 4 * window, settings.device)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    busy = sum(k["device_ms_per_step"] for k in kernels) if kernels else None
    return {"skipped_steps": skip, "window_steps": window, "wall_ms_per_step": wall * 1e3,
            "gpu_busy_ms_per_step": busy, "host_own_ms_by_kind": own, "gpu_top": kernels[:20], "host_top": host}


def timed_window(step: Any, steps: int, device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def gpu_kernels_per_step(step: Any, steps: int) -> list[dict[str, Any]]:
    """The GPU's kernels and copies by device time per step, longest first (torch.profiler). Their sum is
    the GPU's busy time, counting twice what two streams run at once (the LoRA side stream)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:90], "calls_per_step": e.count / steps,
             "device_ms_per_step": e.self_device_time_total / 1e3 / steps}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["device_ms_per_step"])


def host_profile(step: Any, steps: int, top: int = 30) -> list[dict[str, Any]]:
    """The `top` functions by cumulative host time, per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    return function_rows(pstats.Stats(profiler), steps, "cumtime_ms_per_step", top)


def function_rows(stats: pstats.Stats, steps: int, key: str, top: int) -> list[dict[str, Any]]:
    """The `top` functions of `stats` by `key` (cumtime_ms_per_step or tottime_ms_per_step), per step."""
    table = stats.stats                   # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, _)
    rows = [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": nc / steps,
             "tottime_ms_per_step": tt * 1e3 / steps, "cumtime_ms_per_step": ct * 1e3 / steps}
            for (file, line, name), (_, nc, tt, ct, _) in table.items()]
    return sorted(rows, key=lambda r: -r[key])[:top]


def host_ms_by_kind(engine: Any, steps: int, device: str) -> dict[str, dict[str, Any]]:
    """The host's own work per step by the kind of step it launches (issue 22: a mixed step's no more
    than a decode step's), each `engine.step()` started on an idle GPU: `steps` calls timed plainly, then
    `steps` more under cProfile, whose functions by own time say where it goes (a call that blocks on the
    GPU, such as a full launch queue, shows there)."""
    times = calls_by_kind(engine, steps, device, lambda: timed_call(engine.step))
    profiles = calls_by_kind(engine, steps, device, lambda: profiled_call(engine.step))
    return kind_rows(times, profiles, 15)


def kind_rows(times: dict[str, list[float]], profiles: dict[str, list[cProfile.Profile]],
              top: int) -> dict[str, dict[str, Any]]:
    """Per step kind: its calls' median and mean seconds (in ms), and the `top` functions of its profiled
    calls by own and by cumulative time (none where no profiled call was of that kind)."""
    def functions(kind: str, key: str) -> list[dict[str, Any]]:
        runs = profiles.get(kind)
        return function_rows(pstats.Stats(*runs), len(runs), key, top) if runs else []
    return {kind: {"steps": len(values), "median_ms": 1e3 * statistics.median(values),
                   "mean_ms": 1e3 * statistics.fmean(values),
                   "top_own_time": functions(kind, "tottime_ms_per_step"),
                   "top_cumulative": functions(kind, "cumtime_ms_per_step")}
            for kind, values in times.items()}


def timed_call(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def profiled_call(call: Callable[[], object]) -> cProfile.Profile:
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    return profiler


def calls_by_kind(engine: Any, steps: int, device: str, call: Callable[[], T],
                  idle_gpu: bool = True) -> dict[str, list[T]]:
    """`steps` results of `call` (one `engine.step()` each, on an idle GPU unless idle_gpu is False: then
    each follows the one before at once, as in a serving loop) by the kind of step each launched. Under
    overlapped scheduling call i launches step i and takes step i-1's tokens, which is when step i-1's kind
    is recorded; call i's result goes to step i's kind (it holds step i-1's output work). Steps with prefill
    rows are split by size: up to mixed_graph_tokens (graphed), and past them (eager)."""
    results: dict[str, list[T]] = {}
    previous: T | None = None
    cuda = engine.config.cuda
    graph_tokens = 0 if device == "cpu" or cuda.enforce_eager else cuda.mixed_graph_tokens
    for _ in range(steps):
        before_steps, before_tokens = dict(engine.step_stats.steps), dict(engine.step_stats.tokens)
        if idle_gpu:
            synchronize(device)
        result = call()
        recorded = [kind for kind, n in engine.step_stats.steps.items() if n > before_steps[kind]]
        if previous is not None and len(recorded) == 1:
            tokens = engine.step_stats.tokens[recorded[0]] - before_tokens[recorded[0]]
            results.setdefault(step_label(recorded[0], tokens, graph_tokens), []).append(previous)
        previous = result
    return results


def step_label(kind: str, tokens: int, graph_tokens: int) -> str:
    if kind == "decode":
        return kind
    if tokens <= graph_tokens:
        return f"{kind}, graphed (<= {graph_tokens} tokens)"
    return f"{kind}, eager (> {graph_tokens} tokens)"


def result_row(load: Workload, settings: Settings, wall: float, warm_s: float,
               steps: dict[str, Any]) -> dict[str, Any]:
    gen_tokens = sum(r.output_len for r in load.trace)
    vllm = VLLM[load.name]
    gen_tok_s = gen_tokens / wall
    return {"workload": load.name, "requests": len(load.trace),
            "prompt_tokens": sum(r.prompt_len for r in load.trace), "output_len": load.output_len,
            "gen_tokens": gen_tokens, "wall_s": wall, "gen_tok_s": gen_tok_s, "req_s": len(load.trace) / wall,
            "adapters": len({r.adapter for r in load.trace if r.adapter is not None}),
            "adapter_set": asdict(load.adapters) if load.adapters else None,
            "vllm_gen_tok_s": vllm.gen_tok_s, "vllm_req_s": vllm.req_s,
            "vllm_lora_off_gen_tok_s": vllm.lora_off_gen_tok_s,
            "vs_vllm": gen_tok_s / vllm.gen_tok_s if settings.full_size_cuda else None,
            "warm_up_s": warm_s, "steps": steps}


# ---- the run ----------------------------------------------------------------------------------------------
def payload(settings: Settings, setup: ModelSetup, engine: dict[str, Any], rows: list[dict[str, Any]],
            extra: dict[str, Any]) -> dict[str, Any]:
    sizes = settings.sizes
    return {"benchmark": "engine_throughput", "device": settings.device, "quick": settings.quick,
            "model": setup.description, "engine": engine, "sizes": asdict(sizes),
            "trace": {"generator": "workloads.slora_trace", "num_requests": sizes.trace_requests,
                      "num_adapters": sizes.trace_adapters, "alpha": settings.alpha, "cv": 1.0,
                      "length_range": list(sizes.trace_lengths), "seed": SEED,
                      "popularity": "power law: adapter int(power(alpha) * n), alpha < 1 favours low indices"},
            "method": "every request of a workload submitted at once through LLM.generate, greedy, ignore_eos, "
                      "fixed output lengths; one engine for all workloads; a warm-up (the first "
                      f"{sizes.warm_up_requests} requests, {sizes.warm_up_tokens} tokens each, other prompts) "
                      "before each timed run, not counted; gen_tok_s = generated tokens / wall_s",
            "vllm_reference": "vLLM 0.26.0 on one H200 (FA3, torch.compile, full and piecewise CUDA graphs, "
                              "max_loras 32, max_lora_rank 16), issue 22's table; vs_vllm only for full-size "
                              "CUDA runs",
            **extra, "rows": rows}


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"workload": r["workload"], "requests": r["requests"], "gen_tokens": r["gen_tokens"],
             "wall_s": r["wall_s"], "gen_tok_s": r["gen_tok_s"], "req_s": r["req_s"],
             "vllm_gen_tok_s": r["vllm_gen_tok_s"], "vs_vllm": r["vs_vllm"]} for r in rows]


def run(settings: Settings, out: Path) -> dict[str, Any]:
    """Every picked workload on one engine; the JSON is rewritten after each, so a run cut short by a time
    limit keeps the workloads it finished."""
    start = time.perf_counter()
    loads = [build_workload(name, settings.sizes, settings.alpha) for name in settings.workloads]
    with tempfile.TemporaryDirectory(prefix="slora-engine-throughput-") as tmp:
        setup = prepare_model(settings.device, Path(tmp))
        sets = list({load.adapters.name: load.adapters for load in loads if load.adapters}.values())
        named_paths = write_adapter_sets(Path(tmp) / "adapters", setup, sets)
        engine = engine_kwargs(setup, settings)
        llm = build_engine(setup, settings)
        extra = {"setup_s": time.perf_counter() - start, "adapter_load_s": load_adapters(llm, named_paths)}
        rows: list[dict[str, Any]] = []
        data: dict[str, Any] = {}
        for load in loads:
            rows.append(run_workload(llm, load, settings, setup.vocab_size))
            if settings.profile is not None:
                rows[-1]["profile"] = profile_workload(llm, load, settings, setup.vocab_size)
            logger.info("%s: %.1f gen tok/s", load.name, rows[-1]["gen_tok_s"])
            data = payload(settings, setup, engine, rows, {**extra, "wall_seconds": time.perf_counter() - start})
            write_json(out, {**data, "partial": len(rows) < len(loads)})
    return data


def parse_windows(text: str) -> tuple[int, int]:
    """SKIP,STEPS: steps skipped, then steps per profile window."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(f"--profile takes SKIP,STEPS (two integers, STEPS >= 1), got {text!r}")
    return int(parts[0]), int(parts[1])


def parse_workloads(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI): a few short requests per workload")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--workloads", type=parse_workloads, default=WORKLOADS,
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                        help="the trace's power-law exponent of adapter popularity (1: uniform)")
    add_engine_arg(parser, "enforce_eager=true")
    parser.add_argument("--profile", nargs="?", type=parse_windows, const=PROFILE_WINDOWS, default=None,
                        metavar="SKIP,STEPS",
                        help="after each workload, profile its steps: wall, GPU busy and host time; SKIP steps "
                             f"skipped, then three windows of STEPS (default {PROFILE_WINDOWS[0]},"
                             f"{PROFILE_WINDOWS[1]}: the steady state of the decode rows)")
    parser.add_argument("--out", default=None, help="JSON file (default: results/engine_throughput_<device>.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("slora").setLevel(logging.WARNING)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    profile = QUICK_PROFILE_WINDOWS if args.quick and args.profile == PROFILE_WINDOWS else args.profile
    settings = Settings(device, args.quick, args.workloads, args.alpha, dict(args.engine_arg), profile)
    out = Path(args.out or RESULTS / f"engine_throughput_{'cpu' if device == 'cpu' else 'gpu'}.json")
    data = run(settings, out)
    print_table(table_rows(data["rows"]))


if __name__ == "__main__":
    main()
