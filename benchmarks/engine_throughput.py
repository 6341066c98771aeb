"""Offline throughput of the engine: every request of a workload submitted at once through `LLM.generate`.
One script, the workloads as options (--workloads, comma-separated; "vllm", the default, is the first six;
"all" is every one):

  vLLM's side by side (vLLM 0.26.0 measured on one H200 in the same command as slora, 2026-12-01; the GPU
  machine cannot install vLLM, so its figures are kept here and each row gives `vs_vllm`, for full-size CUDA
  runs). A Llama-3-8B-shaped model with random bf16 weights (`load_format="dummy"`), PEFT adapter folders
  with random weights, greedy, `ignore_eos`, fixed output lengths; max_num_seqs 256, max_loras 32,
  max_lora_rank 16; one engine for the six; each workload's prompts come from a seed of its own (timed and
  warm-up prompts apart), so none hits another's prefix cache; a warm-up (the workload's first requests, a
  few tokens each, other prompts) runs before each timed run, uncounted.

    decode_base          256 x (16 prompt -> 512 out), no adapter
    decode_32_adapters   the same, 32 distinct rank-16 adapters on all 7 projections, round robin
    prefill              256 x (1,024 prompt -> 1 out), no adapter (req/s is the figure)
    mixed_base           256 x (512 -> 128), no adapter
    mixed_32_adapters    256 x (512 -> 128), 32 rank-16 adapters on all 7 projections, round robin
    slora_trace          600 requests of `workloads.slora_trace`, lengths uniform in [8, 512] in and out, 100
                         rank-8 q/k/v/o adapters, power-law popularity (--alpha, default 0.8: S-LoRA's own
                         setting of its H100 runs; alpha 1 is uniform)

  Against transformers + PEFT, both systems in one process on the same prompts and adapters:

    adapter_sweep        S-LoRA's trace (uniform popularity, rank-8 q/k/v/o adapters) at time 0 with 1, 5, 100,
                         1,000 and 2,000 adapters (--counts), adapters added to one engine and one PeftModel as
                         the count grows; PEFT in arrival order, left-padded batches of 64 with `adapter_names`.
                         Rates over the mean of --repeats timed runs after a warm-up; a count whose PEFT loading
                         is projected past --peft-budget-s is not measured. `slora_kept`: the largest count's
                         requests/s over the 5-adapter one's. CPU: slora-tiny-llama, lengths [8, 64].
    smollm2_peft         the default model's shape (SmolLM2-135M-Instruct) with its three demo adapters and base
                         rows round robin, random prompts of one length, greedy, batches of --batches, against
                         PEFT mixed-adapter `generate`; --random-weights CONFIG runs that config with random
                         weights (a machine without the model's files).

--quick: small sizes (on the CPU, slora-tiny-llama for all but smollm2_peft), which the smoke test runs.

    python benchmarks/engine_throughput.py [--quick] [--device cpu|cuda] [--workloads vllm|all|NAME,...]
                                           [--alpha A] [--engine-arg KEY=VALUE ...] [--profile [SKIP,STEPS]]
                                           [--counts 1,5,100] [--num-requests N] [--repeats N] [--skip-peft]
                                           [--batches 64,256] [--random-weights CONFIG] [--out FILE]
"""
import argparse
import cProfile
import dataclasses
import gc
import json
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

import numpy as np
import torch
from common import (
    ATTENTION,
    LOAD_THREADS,
    PROJECTIONS,
    SLORA_LENGTHS,
    ModelSetup,
    adapter_name,
    add_engine_arg,
    bandwidth_columns,
    default_out,
    make_prompts,
    prepare_model,
    print_table,
    write_adapters,
    write_json,
)
from workloads import Request, adapter_ranks, slora_trace

logger = logging.getLogger("benchmarks.engine_throughput")
T = TypeVar("T")
SEED = 42
# S-LoRA's power-law exponent of its H100 breakdown suite (benchmarks/exp_suite.py); np.random.power(1) is
# uniform, smaller values put more requests on the low adapter indices.
DEFAULT_ALPHA = 0.8
# The engine settings of the vLLM run (max_loras, max_lora_rank; max_num_seqs as vLLM was given it).
ENGINE_SETTINGS = MappingProxyType({"max_num_seqs": 256, "max_loras": 32, "max_lora_rank": 16})
SMOLLM2_CONFIG = Path(__file__).resolve().parent / "smollm2_config.json"


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
    """The workloads' sizes: vLLM's run (FULL), or small ones for CI (QUICK)."""
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
    """vLLM 0.26.0's figure for a workload on the H200 (the side-by-side run of 2026-12-01)."""
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
    """The host's own work per step by the kind of step it launches (a mixed step's, against
    a decode step's), each `engine.step()` started on an idle GPU: `steps` calls timed plainly, then
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


# ---- against transformers + PEFT: adapter_sweep and smollm2_peft --------------------------------------------
PEFT_WORKLOADS = ("adapter_sweep", "smollm2_peft")
ALL_WORKLOADS = WORKLOADS + PEFT_WORKLOADS
SWEEP_WARM_UP_TOKENS = 4


@dataclass(frozen=True)
class SweepSettings:
    """adapter_sweep's sizes: S-LoRA's trace, rank-8 q/k/v/o adapters, uniform popularity."""
    device: str
    counts: tuple[int, ...]
    num_requests: int
    length_range: tuple[int, int]
    batch: int                         # PEFT's batch and slora's max_num_seqs
    peft_budget_s: float
    repeats: int
    skip_peft: bool
    engine_args: dict[str, Any]

    @property
    def max_model_len(self) -> int:
        return 2 * self.length_range[1] + 16


def sweep_settings(args: argparse.Namespace, device: str) -> SweepSettings:
    gpu = device != "cpu"
    if args.quick:
        counts, requests, lengths, batch = (1, 5, 20), 24, (8, 16), 8
    else:
        counts, requests, lengths, batch = (1, 5, 100, 1000, 2000), (100 if gpu else 256), \
            (SLORA_LENGTHS if gpu else (8, 64)), 64
    if args.counts:
        counts = tuple(int(c) for c in args.counts.split(","))
    budget = args.peft_budget_s if args.peft_budget_s is not None else 20.0 if args.quick else 300.0 if gpu else 90.0
    return SweepSettings(device, counts, args.num_requests or requests, lengths, batch, budget,
                         args.repeats or (1 if args.quick else 3), args.skip_peft, dict(args.engine_arg))


def free_memory(device: str) -> None:
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


def build_hf_model(setup: ModelSetup) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not setup.dummy:
        return AutoModelForCausalLM.from_pretrained(str(setup.folder), dtype=setup.dtype).to(setup.device).eval()
    with torch.device(setup.device):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(setup.folder)), dtype=setup.dtype).eval()


@dataclass
class PeftState:
    """One PeftModel that adapters are added to as the sweep grows. Building it (the base model and the first
    adapter) is timed apart from each further `load_adapter`, whose times drive the projection."""
    setup: ModelSetup
    paths: list[Path]
    model: Any = None
    build_s: float = 0.0
    load_times: list[float] = field(default_factory=list)    # adapters 1, 2, ...
    skipped_reason: str | None = None
    skipped_at: int | None = None                             # the first adapter count not measured

    @property
    def loaded(self) -> int:
        return 0 if self.model is None else 1 + len(self.load_times)

    @property
    def total_load_s(self) -> float:
        return self.build_s + float(sum(self.load_times))

    def projected_s(self, target: int) -> float:
        """Seconds to load adapters `loaded`..target-1: a linear fit of the per-adapter time against the number
        already loaded (PEFT walks every module on each load) once there are 20 samples, else their mean."""
        if not self.load_times or target <= self.loaded:
            return 0.0
        times = np.asarray(self.load_times)
        if len(times) < 20:
            return float(times.mean()) * (target - self.loaded)
        slope, intercept = np.polyfit(np.arange(1, len(times) + 1), times, 1)
        rest = np.arange(self.loaded, target)
        return float(np.maximum(intercept + slope * rest, times.min()).sum())

    def load_up_to(self, target: int, deadline: float) -> bool:
        """Load adapters until `target` are loaded; False if the deadline passes first."""
        from peft import PeftModel

        if self.model is None:
            start = time.perf_counter()
            self.model = PeftModel.from_pretrained(build_hf_model(self.setup), str(self.paths[0]),
                                                   adapter_name=adapter_name(0), low_cpu_mem_usage=True,
                                                   autocast_adapter_dtype=False).eval()
            self.build_s = time.perf_counter() - start
        while self.loaded < target:
            if time.perf_counter() > deadline:
                return False
            start, index = time.perf_counter(), self.loaded
            self.model.load_adapter(str(self.paths[index]), adapter_name=adapter_name(index),
                                    low_cpu_mem_usage=True, autocast_adapter_dtype=False)
            self.load_times.append(time.perf_counter() - start)
        return True


def left_pad(rows: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def peft_generate(model: Any, prompts: list[list[int]], names: list[str], new_tokens: int, lengths: list[int],
                  device: str) -> int:
    """One left-padded mixed-adapter batch, `new_tokens` for every row; returns the output tokens counted (each
    row up to its own length: the rest is the padding work static batching pays for)."""
    ids, mask = left_pad(prompts, device)
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    generated = out.shape[1] - ids.shape[1]
    return sum(min(length, generated) for length in lengths)


@dataclass(frozen=True)
class Run:
    seconds: float
    output_tokens: int
    steps: dict[str, Any] | None = None     # slora's step statistics of the run (StepStats.as_dict)


@dataclass(frozen=True)
class SweepLoad:
    trace: list[Request]
    prompt_sets: list[list[list[int]]]   # one per repeat, each with its own tokens: no prefix-cache hits
    warm_prompts: list[list[int]]


def sweep_load(settings: SweepSettings, count: int, vocab_size: int) -> SweepLoad:
    trace = slora_trace(settings.num_requests, count, rate=1.0, length_range=settings.length_range, seed=SEED)
    seed = SEED * 100_000 + count * 10
    return SweepLoad(trace, [make_prompts(trace, vocab_size, seed + k) for k in range(settings.repeats)],
                     make_prompts(trace, vocab_size, seed + 9))


def sweep_peft_runs(model: Any, load: SweepLoad, batch: int, device: str) -> list[Run]:
    """One run per prompt set: the whole trace in arrival order, batches of up to `batch`."""
    def batches(prompts: list[list[int]], trace: list[Request]) -> int:
        tokens = 0
        for first in range(0, len(trace), batch):
            part = trace[first:first + batch]
            tokens += peft_generate(model, prompts[first:first + batch], [adapter_name(r.adapter) for r in part],
                                    max(r.output_len for r in part), [r.output_len for r in part], device)
        return tokens

    warm = [dataclasses.replace(r, output_len=SWEEP_WARM_UP_TOKENS) for r in load.trace[:batch]]
    batches(load.warm_prompts[:batch], warm)                                  # warm-up: a full first batch
    runs = []
    for prompts in load.prompt_sets:
        synchronize(device)
        start = time.perf_counter()
        tokens = batches(prompts, load.trace)
        synchronize(device)
        runs.append(Run(time.perf_counter() - start, tokens))
    return runs


def sweep_slora_runs(llm: Any, load: SweepLoad, device: str) -> list[Run]:
    """One run per prompt set: every request submitted at once."""
    from slora.core.step_stats import StepStats

    trace, names = load.trace, [adapter_name(r.adapter) for r in load.trace]
    warm = min(len(trace), llm.engine.config.max_num_seqs)                # warm-up: a full batch, a few tokens
    generate_all(llm, load.warm_prompts[:warm], [SWEEP_WARM_UP_TOKENS] * warm, names[:warm])
    runs = []
    for prompts in load.prompt_sets:
        llm.engine.step_stats = StepStats()
        synchronize(device)
        start = time.perf_counter()
        outputs = generate_all(llm, prompts, [r.output_len for r in trace], names)
        synchronize(device)
        elapsed = time.perf_counter() - start
        for request, output in zip(trace, outputs):
            if len(output.outputs[0].token_ids) != request.output_len:
                raise RuntimeError(f"adapter_sweep: {len(output.outputs[0].token_ids)} tokens for a request of "
                                   f"{request.output_len}")
        runs.append(Run(elapsed, sum(len(o.outputs[0].token_ids) for o in outputs), llm.engine.step_stats.as_dict()))
    return runs


@dataclass
class CountResult:
    num_adapters: int
    distinct_adapters: int
    requests: int
    expected_output_tokens: int
    slora_runs: list[Run] = field(default_factory=list)
    slora_setup_s: float = 0.0
    peft_runs: list[Run] = field(default_factory=list)
    peft_setup_s: float | None = None
    peft_status: str = "measured"

    def system(self, name: str, runs: list[Run]) -> dict[str, Any]:
        """Throughput from the mean time of the runs; each run's requests/s; output tokens (equal in every run)."""
        if not runs:
            return {f"{name}_req_s": None, f"{name}_tok_s": None, f"{name}_req_s_runs": [],
                    f"{name}_seconds": None, f"{name}_output_tokens": None}
        if len({r.output_tokens for r in runs}) != 1:
            raise RuntimeError(f"{name}: runs counted different numbers of output tokens")
        seconds = float(np.mean([r.seconds for r in runs]))
        return {f"{name}_req_s": self.requests / seconds, f"{name}_tok_s": runs[0].output_tokens / seconds,
                f"{name}_req_s_runs": [self.requests / r.seconds for r in runs], f"{name}_seconds": seconds,
                f"{name}_output_tokens": runs[0].output_tokens}

    def row(self) -> dict[str, Any]:
        row = {"workload": "adapter_sweep", "num_adapters": self.num_adapters,
               "distinct_adapters": self.distinct_adapters, "requests": self.requests,
               "expected_output_tokens": self.expected_output_tokens, **self.system("slora", self.slora_runs),
               "slora_setup_s": self.slora_setup_s, **self.system("peft", self.peft_runs),
               "peft_setup_s": self.peft_setup_s, "peft_status": self.peft_status}
        row["speedup_req_s"] = row["slora_req_s"] / row["peft_req_s"] if row["peft_req_s"] else None
        return {**row, **decode_roofline(self.slora_runs)}


def decode_roofline(runs: list[Run]) -> dict[str, Any]:
    """The decode steps of slora's runs against the memory roofline (bytes they had to read / their time; the
    percentage is of the H200's 4.24 TB/s copy bandwidth) and the share of time they took."""
    stats = [r.steps for r in runs if r.steps]
    decode_s = sum(s["seconds"]["decode"] for s in stats)
    share = decode_s / sum(r.seconds for r in runs) if decode_s else None
    return {**bandwidth_columns(sum(s["decode_bytes"] for s in stats), decode_s, "slora_decode"),
            "slora_decode_time_share": share, "slora_steps": stats}


def sweep_peft(state: PeftState, settings: SweepSettings, loads: dict[int, SweepLoad],
               results: dict[int, CountResult]) -> None:
    for count in settings.counts:
        result = results[count]
        if state.skipped_reason is None:
            left = settings.peft_budget_s - state.total_load_s          # only loading counts against the budget
            projected = state.projected_s(count)
            if projected > left:
                state.skipped_reason = (f"not measured: loading {count - state.loaded} more adapters was projected "
                                        f"at {projected:.0f} s, {max(left, 0):.0f} s of the "
                                        f"{settings.peft_budget_s:.0f} s loading budget left")
            elif not state.load_up_to(count, time.perf_counter() + left):
                state.skipped_reason = (f"not measured: the {settings.peft_budget_s:.0f} s loading budget ran out "
                                        f"after {state.loaded} of {count} adapters")
        if state.skipped_reason is not None:
            first = state.skipped_at = state.skipped_at or count
            result.peft_status = state.skipped_reason if first == count else \
                f"not measured: PEFT stopped at {first} adapters ({state.loaded} loaded)"
            continue
        result.peft_setup_s = state.total_load_s
        result.peft_runs = sweep_peft_runs(state.model, loads[count], settings.batch, settings.device)
        logger.info("adapter_sweep, PEFT at %d adapters: %s s", count, [round(r.seconds, 2) for r in result.peft_runs])


def sweep_slora(setup: ModelSetup, paths: list[Path], settings: SweepSettings, loads: dict[int, SweepLoad],
                results: dict[int, CountResult], on_count: Callable[[], None]) -> None:
    kwargs = {**model_kwargs(setup), "max_num_seqs": settings.batch, "max_model_len": settings.max_model_len,
              # The tiny model's engine also registers its demo adapters, the largest of rank 16.
              "max_lora_rank": 8 if setup.dummy else 16, "seed": SEED, **settings.engine_args}
    start = time.perf_counter()
    llm, loaded = new_llm(setup, kwargs), 0
    setup_s = time.perf_counter() - start                  # cumulative: the engine, then the adapters so far
    try:
        for count in settings.counts:
            start = time.perf_counter()
            load_adapters(llm, [(adapter_name(i), paths[i]) for i in range(loaded, count)])
            setup_s += time.perf_counter() - start
            loaded = max(loaded, count)
            result = results[count]
            result.slora_setup_s = setup_s
            result.slora_runs = sweep_slora_runs(llm, loads[count], settings.device)
            logger.info("adapter_sweep, slora at %d adapters: %s s", count,
                        [round(r.seconds, 2) for r in result.slora_runs])
            on_count()
    finally:
        del llm
        free_memory(setup.device)


def kept_ratio(rows: list[dict[str, Any]], low: int = 5) -> dict[str, Any] | None:
    """slora's requests/s at the largest count against that at `low` adapters."""
    by_count = {r["num_adapters"]: r for r in rows if r["slora_req_s"]}
    if low not in by_count or max(by_count) == low:
        return None
    high = max(by_count)
    return {"from": low, "to": high, "ratio": by_count[high]["slora_req_s"] / by_count[low]["slora_req_s"]}


def run_adapter_sweep(settings: SweepSettings, workdir: Path, on_rows: Callable[[dict[str, Any]], None]) -> dict:
    """PEFT first (on a GPU it must be gone before slora sizes its pool), then slora; `on_rows` gets the
    section after each slora count."""
    setup = prepare_model(settings.device, workdir)
    paths = write_adapters(workdir / "sweep-adapters", setup, adapter_ranks(max(settings.counts), False), ATTENTION)
    loads = {c: sweep_load(settings, c, setup.vocab_size) for c in settings.counts}
    results = {c: CountResult(c, len({r.adapter for r in w.trace}), len(w.trace), sum(r.output_len for r in w.trace))
               for c, w in loads.items()}
    torch.manual_seed(SEED)
    if settings.skip_peft:
        for result in results.values():
            result.peft_status = "not run (--skip-peft)"
    else:
        peft = PeftState(setup, paths)
        try:
            sweep_peft(peft, settings, loads, results)
        finally:
            peft.model = None
            free_memory(settings.device)

    def section() -> dict[str, Any]:
        rows = [results[c].row() for c in settings.counts if results[c].slora_runs]
        return {"model": setup.description, "counts": list(settings.counts), "num_requests": settings.num_requests,
                "length_range": list(settings.length_range), "adapters": "rank 8 on q/k/v/o, uniform popularity",
                "batch": settings.batch, "repeats": settings.repeats, "peft_budget_s": settings.peft_budget_s,
                "peft_measured_at": [r["num_adapters"] for r in rows if r["peft_req_s"] is not None],
                "slora_kept": kept_ratio(rows), "rows": rows}

    sweep_slora(setup, paths, settings, loads, results, lambda: on_rows(section()))
    return section()


@dataclass(frozen=True)
class Smollm2Settings:
    device: str
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    random_weights: str | None       # a config.json to run with random weights, None: the model's own
    skip_peft: bool
    engine_args: dict[str, Any]


def smollm2_settings(args: argparse.Namespace, device: str) -> Smollm2Settings:
    if args.quick:
        batches, prompt, new = (1, 4), 16, 8
    elif device == "cpu":
        batches, prompt, new = (1, 8, 32), 64, 32
    else:
        batches, prompt, new = (64, 256), 16, 256
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    return Smollm2Settings(device, batches, prompt, new, args.random_weights, args.skip_peft, dict(args.engine_arg))


def run_smollm2_peft(settings: Smollm2Settings, workdir: Path) -> dict[str, Any]:
    """slora and PEFT on the default model (or its config with random weights) and its demo adapters, mixed
    round robin with base rows; slora's decode steps also on their own (tokens/s, and on a GPU the bytes they
    read per second against its copy bandwidth)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slora import LLM
    from slora.core.step_stats import StepStats
    from slora.models.builtin import DEFAULT_MODEL, resolve_model, shipped_demo_adapters

    dtype = torch.float32 if settings.device == "cpu" else torch.bfloat16
    kwargs = {"device": settings.device, "max_num_seqs": max(settings.batches), "seed": SEED, **settings.engine_args}
    if settings.random_weights:
        folder = workdir / "smollm2"
        folder.mkdir()
        (folder / "config.json").write_text(Path(settings.random_weights).read_text())
        adapters = shipped_demo_adapters()
        llm = LLM(str(folder), load_format="dummy", **kwargs)
        for name, path in adapters.items():
            llm.load_adapter(name, str(path))
        hf = None if settings.skip_peft else AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(str(folder)), dtype=dtype)
    else:
        source = resolve_model(DEFAULT_MODEL)
        folder, adapters = source.folder, source.demo_adapters
        llm = LLM(DEFAULT_MODEL, **kwargs)
        hf = None if settings.skip_peft else AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    peft = None
    if hf is not None:
        from peft import PeftModel

        names = list(adapters)
        peft = PeftModel.from_pretrained(hf.to(settings.device).eval(), str(adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            peft.load_adapter(str(adapters[name]), adapter_name=name)
        peft.eval()
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    mix = [*adapters, None]
    rows = []
    for batch in settings.batches:
        trace = [Request(settings.prompt_len, settings.new_tokens, None, 0, 0.0)] * batch
        prompts = make_prompts(trace, vocab_size, SEED)
        names = [mix[i % len(mix)] for i in range(batch)]
        generate_all(llm, prompts[:1], [2], names[:1])                  # warm-up
        llm.engine.step_stats = StepStats()
        synchronize(settings.device)
        start = time.perf_counter()
        outputs = generate_all(llm, prompts, [settings.new_tokens] * batch, names)
        synchronize(settings.device)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == settings.new_tokens for o in outputs)
        stats = llm.engine.step_stats
        decode_s = stats.seconds["decode"]
        row = {"workload": "smollm2_peft", "batch": batch, "prompt_len": settings.prompt_len,
               "new_tokens": settings.new_tokens, "slora_tok_s": batch * settings.new_tokens / elapsed,
               "slora_decode_tok_s": stats.tokens["decode"] / decode_s if decode_s else None}
        if settings.device != "cpu":
            row.update(bandwidth_columns(stats.decode_bytes, decode_s, "slora_decode"))
        if peft is not None:
            synchronize(settings.device)
            start = time.perf_counter()
            peft_generate(peft, prompts, [n or "__base__" for n in names], settings.new_tokens,
                          [settings.new_tokens] * batch, settings.device)      # equal lengths: no padding
            synchronize(settings.device)
            row["peft_tok_s"] = batch * settings.new_tokens / (time.perf_counter() - start)
            row["ratio"] = row["slora_tok_s"] / row["peft_tok_s"]
        rows.append(row)
    del llm, peft, hf
    free_memory(settings.device)
    return {"model": DEFAULT_MODEL, "random_weights": settings.random_weights, "adapters": list(adapters),
            "mix": "the demo adapters and base rows, round robin", "rows": rows}


# ---- the run ----------------------------------------------------------------------------------------------
def vllm_payload(settings: Settings, setup: ModelSetup, engine: dict[str, Any]) -> dict[str, Any]:
    sizes = settings.sizes
    return {"model": setup.description, "engine": engine, "sizes": asdict(sizes),
            "trace": {"generator": "workloads.slora_trace", "num_requests": sizes.trace_requests,
                      "num_adapters": sizes.trace_adapters, "alpha": settings.alpha, "cv": 1.0,
                      "length_range": list(sizes.trace_lengths), "seed": SEED,
                      "popularity": "power law: adapter int(power(alpha) * n), alpha < 1 favours low indices"},
            "method": "every request of a workload submitted at once through LLM.generate, greedy, ignore_eos, "
                      "fixed output lengths; one engine for all workloads; a warm-up (the first "
                      f"{sizes.warm_up_requests} requests, {sizes.warm_up_tokens} tokens each, other prompts) "
                      "before each timed run, not counted; gen_tok_s = generated tokens / wall_s",
            "vllm_reference": "vLLM 0.26.0 on one H200 (FA3, torch.compile, full and piecewise CUDA graphs, "
                              "max_loras 32, max_lora_rank 16), measured beside slora on 2026-12-01; vs_vllm "
                              "only for full-size CUDA runs"}


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"workload": r["workload"], "requests": r["requests"], "gen_tokens": r["gen_tokens"],
             "wall_s": r["wall_s"], "gen_tok_s": r["gen_tok_s"], "req_s": r["req_s"],
             "vllm_gen_tok_s": r["vllm_gen_tok_s"], "vs_vllm": r["vs_vllm"]} for r in rows]


def sweep_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"adapters": r["num_adapters"], "distinct": r["distinct_adapters"], "slora_req_s": r["slora_req_s"],
             "slora_tok_s": r["slora_tok_s"], "peft_req_s": r["peft_req_s"], "speedup": r["speedup_req_s"],
             "slora_setup_s": r["slora_setup_s"], "decode_TB_s": r["slora_decode_tb_s"],
             "decode_share": r["slora_decode_time_share"]} for r in rows]


def smollm2_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"batch": r["batch"], "slora_tok_s": r["slora_tok_s"], "slora_decode_tok_s": r["slora_decode_tok_s"],
             "peft_tok_s": r.get("peft_tok_s"), "ratio": r.get("ratio")} for r in rows]


def run_vllm_workloads(settings: Settings, workdir: Path, data: dict[str, Any], save: Callable[[], None]) -> None:
    """Every picked workload of the six on one engine; `save` after each, so a run cut short by a time limit
    keeps the workloads it finished."""
    start = time.perf_counter()
    loads = [build_workload(name, settings.sizes, settings.alpha) for name in settings.workloads if name in VLLM]
    setup = prepare_model(settings.device, workdir)
    sets = list({load.adapters.name: load.adapters for load in loads if load.adapters}.values())
    named_paths = write_adapter_sets(workdir / "adapters", setup, sets)
    llm = build_engine(setup, settings)
    data.update(vllm_payload(settings, setup, engine_kwargs(setup, settings)))
    data.update({"setup_s": time.perf_counter() - start, "adapter_load_s": load_adapters(llm, named_paths)})
    for load in loads:
        data["rows"].append(run_workload(llm, load, settings, setup.vocab_size))
        if settings.profile is not None:
            data["rows"][-1]["profile"] = profile_workload(llm, load, settings, setup.vocab_size)
        logger.info("%s: %.1f gen tok/s", load.name, data["rows"][-1]["gen_tok_s"])
        save()
    del llm
    free_memory(settings.device)


def run(args: argparse.Namespace, device: str, out: Path) -> dict[str, Any]:
    """The picked workloads, the six first; the JSON is rewritten after each workload (or adapter count)."""
    start = time.perf_counter()
    profile = QUICK_PROFILE_WINDOWS if args.quick and args.profile == PROFILE_WINDOWS else args.profile
    settings = Settings(device, args.quick, args.workloads, args.alpha, dict(args.engine_arg), profile)
    data: dict[str, Any] = {"benchmark": "engine_throughput", "device": device, "quick": args.quick,
                            "workloads": list(args.workloads), "rows": []}

    def save(partial: bool = True) -> None:
        write_json(out, {**data, "wall_seconds": time.perf_counter() - start, "partial": partial})

    with tempfile.TemporaryDirectory(prefix="slora-engine-throughput-") as tmp:
        if any(name in VLLM for name in args.workloads):
            run_vllm_workloads(settings, Path(tmp) / "vllm", data, save)
        if "adapter_sweep" in args.workloads:
            def on_rows(section: dict[str, Any]) -> None:
                data["adapter_sweep"] = section
                save()
            data["adapter_sweep"] = run_adapter_sweep(sweep_settings(args, device), Path(tmp) / "sweep", on_rows)
            save()
        if "smollm2_peft" in args.workloads:
            (Path(tmp) / "smollm2").mkdir()
            data["smollm2_peft"] = run_smollm2_peft(smollm2_settings(args, device), Path(tmp) / "smollm2")
    save(partial=False)
    return data


def parse_windows(text: str) -> tuple[int, int]:
    """SKIP,STEPS: steps skipped, then steps per profile window."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(f"--profile takes SKIP,STEPS (two integers, STEPS >= 1), got {text!r}")
    return int(parts[0]), int(parts[1])


def parse_workloads(text: str) -> tuple[str, ...]:
    """Names, "vllm" (the six of vLLM's table) or "all", comma-separated, in ALL_WORKLOADS order."""
    names = set()
    for name in (n.strip() for n in text.split(",") if n.strip()):
        names.update(WORKLOADS if name == "vllm" else ALL_WORKLOADS if name == "all" else [name])
    unknown = sorted(names - set(ALL_WORKLOADS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; choose from vllm, all, "
                                         f"{', '.join(ALL_WORKLOADS)}")
    return tuple(n for n in ALL_WORKLOADS if n in names)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI): a few short requests per workload")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--workloads", type=parse_workloads, default=WORKLOADS,
                        help=f"comma-separated: vllm (the default: {', '.join(WORKLOADS)}), all, or names of "
                             f"{', '.join(ALL_WORKLOADS)}")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                        help="slora_trace's power-law exponent of adapter popularity (1: uniform)")
    add_engine_arg(parser, "enforce_eager=true")
    parser.add_argument("--profile", nargs="?", type=parse_windows, const=PROFILE_WINDOWS, default=None,
                        metavar="SKIP,STEPS",
                        help="after each of the six workloads, profile its steps: wall, GPU busy and host time; "
                             f"SKIP steps skipped, then three windows of STEPS (default {PROFILE_WINDOWS[0]},"
                             f"{PROFILE_WINDOWS[1]}: the steady state of the decode rows)")
    sweep = parser.add_argument_group("adapter_sweep")
    sweep.add_argument("--counts", default=None, help="adapter counts (default 1,5,100,1000,2000; quick 1,5,20)")
    sweep.add_argument("--num-requests", type=int, default=None, help="requests of the trace (default 100 on "
                       "CUDA, 256 on the CPU; quick 24)")
    sweep.add_argument("--repeats", type=int, default=None,
                       help="timed runs per count, each with fresh prompts (default 3; quick 1)")
    sweep.add_argument("--peft-budget-s", type=float, default=None, help="seconds PEFT may spend loading adapters")
    peft = parser.add_argument_group("adapter_sweep and smollm2_peft")
    peft.add_argument("--skip-peft", action="store_true", help="slora alone")
    smollm2 = parser.add_argument_group("smollm2_peft")
    smollm2.add_argument("--batches", default=None, help="batch sizes (default 64,256 on CUDA, 1,8,32 on the CPU)")
    smollm2.add_argument("--random-weights", nargs="?", const=str(SMOLLM2_CONFIG), default=None, metavar="CONFIG",
                         help=f"that config.json with random weights (default {SMOLLM2_CONFIG.name})")
    parser.add_argument("--out", default=None,
                        help="JSON file (default: results/<cpu|h100|h200>/engine_throughput.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("slora", "httpx", "transformers", "peft"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    data = run(args, device, Path(args.out) if args.out else default_out("engine_throughput", device))
    if data["rows"]:
        print_table(table_rows(data["rows"]))
    if "adapter_sweep" in data:
        print_table(sweep_table(data["adapter_sweep"]["rows"]))
        kept = data["adapter_sweep"]["slora_kept"]
        if kept:
            logger.info("slora keeps %.1f%% of its requests/s from %d to %d adapters", 100 * kept["ratio"],
                        kept["from"], kept["to"])
    if "smollm2_peft" in data:
        print_table(smollm2_table(data["smollm2_peft"]["rows"]))


if __name__ == "__main__":
    main()
