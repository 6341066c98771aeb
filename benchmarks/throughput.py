"""Offline throughput on S-LoRA's trace: slora against transformers + PEFT, sweeping the number of adapters
(issue 6, item 2). Same trace, same model, same adapters, same machine, in one run.

Method:
  * Trace: `workloads.slora_trace` (seed 42, cv 1, alpha 1 = uniform popularity), every request available at
    time 0 (offline). Prompts are random token ids, seeded per adapter count (so no prompt of one count
    can hit the prefix cache with pages of another), identical for both systems.
  * transformers + PEFT: one PeftModel; all adapters loaded into it (`load_adapter`), requests taken in
    arrival order in batches of up to `--peft-batch`, each batch left-padded with an attention mask, mixed
    adapters through `adapter_names`, greedy `generate` with max_new_tokens = min_new_tokens = the batch's
    longest output; each row counts only its own output length (the rest is the padding work static
    batching pays for).
  * slora: one `LLM`, all adapters registered (`load_adapter`), `generate` of every request at once, greedy,
    `ignore_eos`, max_tokens = the request's output length, `max_num_seqs` = `--max-num-seqs`.
  * The sweep adds adapters to the same PeftModel / engine as the count grows (1, 5, 100, 1000, 2000).
    Loading is timed but not part of the throughput. Per count: a warm-up (one full batch of other prompts,
    4 new tokens), then `--repeats` timed runs (2; 1 with --quick), each with fresh prompts; throughput is
    requests (output tokens) over the mean run time, and each run's requests/s is kept in the JSON.
  * PEFT's `load_adapter` gets slower with every adapter already loaded (it walks all modules), so its
    loading has a time budget (`--peft-budget-s`): a count whose projected loading time exceeds what is
    left, or whose loading runs out of it, is reported as not measured.

CPU mode (default without CUDA): slora-tiny-llama, lengths scaled down from S-LoRA's [8, 512] to
[8, 64] (stated in the JSON). GPU mode (`--device cuda`): a Llama-3-8B-shaped model with random bf16
weights (`load_format="dummy"`, no download), lengths [8, 512].

    python benchmarks/throughput.py [--quick] [--device cpu|cuda] [--counts 1,5,100] [--out FILE]
"""
import argparse
import dataclasses
import gc
import logging
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import (
    ATTENTION,
    LOAD_THREADS,
    MLP,
    RESULTS,
    SLORA_LENGTHS,
    ModelSetup,
    adapter_name,
    bandwidth_columns,
    make_prompts,
    prepare_model,
    print_table,
    pyplot,
    save_figure,
    write_adapters,
    write_json,
)
from workloads import Request, adapter_ranks, slora_trace

logger = logging.getLogger("benchmarks.throughput")
WARM_UP_TOKENS = 4


# ---- settings ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    device: str
    counts: tuple[int, ...]
    num_requests: int
    length_range: tuple[int, int]
    rank_mix: bool
    targets: tuple[str, ...]
    peft_batch: int
    max_num_seqs: int
    peft_budget_s: float
    repeats: int
    quick: bool
    skip_peft: bool = False
    host_cache_gib: float | None = None
    cv: float = 1.0
    alpha: float = 1.0
    seed: int = 42

    @property
    def max_model_len(self) -> int:
        return 2 * self.length_range[1] + 16


def settings_from_args(args: argparse.Namespace) -> Settings:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device != "cpu"
    if args.quick:
        counts, requests, lengths = (1, 5, 20), 24, (8, 16)
    else:
        counts, requests, lengths = (1, 5, 100, 1000, 2000), (1000 if gpu else 256), \
            (SLORA_LENGTHS if gpu else (8, 64))
    if args.counts:
        counts = tuple(int(c) for c in args.counts.split(","))
    if args.num_requests:
        requests = args.num_requests
    if args.lengths:
        low, high = (int(x) for x in args.lengths.split(","))
        lengths = (low, high)
    batch = 8 if args.quick else 64
    targets = ATTENTION + MLP if args.targets == "all" else tuple(args.targets.split(","))
    return Settings(device, counts, requests, lengths, args.rank_mix, targets,
                    args.peft_batch or batch, args.max_num_seqs or batch,
                    args.peft_budget_s if args.peft_budget_s is not None else (20.0 if args.quick else 90.0 if not gpu
                                                                               else 300.0),
                    args.repeats or (1 if args.quick else 2), args.quick, args.skip_peft, args.host_cache_gib)


# ---- transformers + PEFT ----------------------------------------------------------------------------------
@dataclass
class PeftState:
    """One PeftModel that adapters are added to as the sweep grows. Building it (the base model and the
    first adapter) is timed apart from each further `load_adapter`, whose times drive the projection."""

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

    def close(self) -> None:
        self.model = None
        free_memory(self.setup.device)


def build_hf_model(setup: ModelSetup) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not setup.dummy:
        return AutoModelForCausalLM.from_pretrained(str(setup.folder), dtype=setup.dtype).to(setup.device).eval()
    config = AutoConfig.from_pretrained(str(setup.folder))
    with torch.device(setup.device):
        return AutoModelForCausalLM.from_config(config, dtype=setup.dtype).eval()


def left_pad(rows: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def peft_generate_batch(model: Any, requests: list[Request], prompts: list[list[int]], device: str) -> int:
    """One padded mixed-adapter batch; returns the output tokens counted (each row up to its own length)."""
    ids, mask = left_pad(prompts, device)
    new_tokens = max(r.output_len for r in requests)
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=[adapter_name(r.adapter) for r in requests],
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    generated = out.shape[1] - ids.shape[1]
    return sum(min(r.output_len, generated) for r in requests)


@dataclass(frozen=True)
class Run:
    seconds: float
    output_tokens: int
    steps: dict[str, Any] | None = None     # slora's step statistics of the run (StepStats.as_dict)


def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def run_peft(model: Any, load: "Workload", batch: int, device: str) -> list[Run]:
    """One run per prompt set: the whole trace in arrival order, batches of up to `batch`."""
    trace = load.trace
    warm = [dataclasses.replace(r, output_len=WARM_UP_TOKENS) for r in trace[:batch]]
    peft_generate_batch(model, warm, load.warm_prompts[:batch], device)             # warm-up: a full first batch
    runs = []
    for prompts in load.prompt_sets:
        synchronize(device)
        start, tokens = time.perf_counter(), 0
        for first in range(0, len(trace), batch):
            tokens += peft_generate_batch(model, trace[first:first + batch], prompts[first:first + batch], device)
        synchronize(device)
        runs.append(Run(time.perf_counter() - start, tokens))
    return runs


# ---- slora ------------------------------------------------------------------------------------------------
@dataclass
class SloraState:
    setup: ModelSetup
    paths: list[Path]
    settings: Settings
    llm: Any = None
    loaded: int = 0
    prepare_s: float = 0.0        # reading, validating, hashing and packing adapters (cumulative)
    register_s: float = 0.0       # registering them with the engine (cumulative)

    def load_up_to(self, target: int) -> float:
        from slora import LLM
        from slora.models.builtin import TINY_MODEL

        start = time.perf_counter()
        if self.llm is None:
            kwargs: dict[str, Any] = {"device": self.setup.device, "max_num_seqs": self.settings.max_num_seqs,
                                      "max_lora_rank": self.max_lora_rank(),
                                      "max_model_len": self.settings.max_model_len, "seed": self.settings.seed}
            if self.setup.dummy:
                kwargs["load_format"] = "dummy"
            if self.settings.host_cache_gib is not None:
                kwargs["adapter_host_cache_gib"] = self.settings.host_cache_gib
            model = str(self.setup.folder) if self.setup.dummy else TINY_MODEL
            self.llm = LLM(model, **kwargs)
        self._load_range(self.loaded, target)
        self.loaded = max(self.loaded, target)
        return time.perf_counter() - start

    def _load_range(self, first: int, end: int) -> None:
        """`LLM.load_adapter` of adapters first..end-1 in its two halves: reading, validating and packing on
        a thread pool (`AdapterManager.prepare` may run on any thread, as the server runs it), registering
        in order on this thread. Timed apart (wall time of each phase)."""
        adapters = self.llm.engine.adapters
        with ThreadPoolExecutor(LOAD_THREADS) as pool:
            # A window of adapters at a time: prepared ones are held (pinned on CUDA) until registered.
            for window in range(first, end, 4 * LOAD_THREADS):
                indices = range(window, min(window + 4 * LOAD_THREADS, end))
                start = time.perf_counter()
                prepared = list(pool.map(lambda i: adapters.prepare(self.paths[i]), indices))
                middle = time.perf_counter()
                for index, adapter in zip(indices, prepared):
                    adapters.register(adapter_name(index), adapter)
                self.prepare_s += middle - start
                self.register_s += time.perf_counter() - middle

    def max_lora_rank(self) -> int:
        # The tiny model's engine also registers its demo adapters, the largest of rank 16.
        return max(64 if self.settings.rank_mix else 8, 8 if self.setup.dummy else 16)

    def close(self) -> None:
        self.llm = None
        free_memory(self.setup.device)


def run_slora(llm: Any, load: "Workload", device: str) -> list[Run]:
    """One run per prompt set: every request submitted at once."""
    from slora import SamplingParams
    from slora.core.step_stats import StepStats

    trace, names = load.trace, [adapter_name(r.adapter) for r in load.trace]
    warm = min(len(trace), llm.engine.config.max_num_seqs)                   # warm-up: a full batch, a few tokens
    llm.generate(load.warm_prompts[:warm], SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0, ignore_eos=True),
                 adapters=names[:warm])
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in trace]
    runs = []
    for prompts in load.prompt_sets:
        llm.engine.step_stats = StepStats()
        synchronize(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, adapters=names)
        synchronize(device)
        elapsed = time.perf_counter() - start
        for request, output in zip(trace, outputs):
            produced = len(output.outputs[0].token_ids)
            if produced != request.output_len:
                raise RuntimeError(f"slora produced {produced} tokens for a request of {request.output_len}")
        runs.append(Run(elapsed, sum(len(o.outputs[0].token_ids) for o in outputs), llm.engine.step_stats.as_dict()))
    return runs


def free_memory(device: str) -> None:
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


# ---- the sweep --------------------------------------------------------------------------------------------
@dataclass
class CountResult:
    num_adapters: int
    distinct_adapters: int
    requests: int
    expected_output_tokens: int
    slora_runs: list[Run] = field(default_factory=list)
    slora_setup_s: float = 0.0
    slora_prepare_s: float = 0.0
    slora_register_s: float = 0.0
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
        row = {"num_adapters": self.num_adapters, "distinct_adapters": self.distinct_adapters,
               "requests": self.requests, "expected_output_tokens": self.expected_output_tokens,
               **self.system("slora", self.slora_runs), "slora_setup_s": self.slora_setup_s,
               "slora_prepare_s": self.slora_prepare_s, "slora_register_s": self.slora_register_s,
               **self.system("peft", self.peft_runs), "peft_setup_s": self.peft_setup_s,
               "peft_status": self.peft_status}
        row["speedup_req_s"] = row["slora_req_s"] / row["peft_req_s"] if row["peft_req_s"] else None
        return {**row, **decode_roofline(self.slora_runs)}


def decode_roofline(runs: list[Run]) -> dict[str, Any]:
    """The decode steps of slora's runs against the memory roofline (bytes they had to read / their
    time; the percentage is of the H200's 4.24 TB/s copy bandwidth) and the share of time they took."""
    stats = [r.steps for r in runs if r.steps]
    decode_s = sum(s["seconds"]["decode"] for s in stats)
    share = decode_s / sum(r.seconds for r in runs) if decode_s else None
    return {**bandwidth_columns(sum(s["decode_bytes"] for s in stats), decode_s, "slora_decode"),
            "slora_decode_time_share": share, "slora_steps": stats}


@dataclass(frozen=True)
class Workload:
    trace: list[Request]
    prompt_sets: list[list[list[int]]]   # one per repeat, each with its own tokens: no prefix-cache hits
    warm_prompts: list[list[int]]


def workload(settings: Settings, count: int, vocab_size: int) -> Workload:
    trace = slora_trace(settings.num_requests, count, rate=1.0, cv=settings.cv, alpha=settings.alpha,
                        rank_mix=settings.rank_mix, length_range=settings.length_range, seed=settings.seed)
    seed = settings.seed * 100_000 + count * 10
    return Workload(trace, [make_prompts(trace, vocab_size, seed + k) for k in range(settings.repeats)],
                    make_prompts(trace, vocab_size, seed + 9))


def peft_sweep(state: PeftState, settings: Settings, loads: dict[int, Workload], results: dict[int, CountResult]) -> None:
    for count in settings.counts:
        result = results[count]
        if state.skipped_reason is None:
            left = settings.peft_budget_s - state.total_load_s          # only loading counts against the budget
            deadline = time.perf_counter() + left
            projected = state.projected_s(count)
            if projected > left:
                state.skipped_reason = (f"not measured: loading {count - state.loaded} more adapters was projected "
                                        f"at {projected:.0f} s, {max(left, 0):.0f} s of the {settings.peft_budget_s:.0f} s "
                                        "loading budget left")
            elif not state.load_up_to(count, deadline):
                state.skipped_reason = (f"not measured: the {settings.peft_budget_s:.0f} s loading budget ran out "
                                        f"after {state.loaded} of {count} adapters")
        if state.skipped_reason is not None:
            first = state.skipped_at = state.skipped_at or count
            result.peft_status = state.skipped_reason if first == count else \
                f"not measured: PEFT stopped at {first} adapters ({state.loaded} loaded)"
            logger.info("PEFT at %d adapters: %s", count, result.peft_status)
            continue
        result.peft_setup_s = state.total_load_s
        result.peft_runs = run_peft(state.model, loads[count], settings.peft_batch, settings.device)
        logger.info("PEFT at %d adapters: %s s", count, [round(r.seconds, 2) for r in result.peft_runs])


def slora_sweep(state: SloraState, settings: Settings, loads: dict[int, Workload], results: dict[int, CountResult],
                on_count: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
    """slora at each count; `on_count` gets the rows measured so far after each one."""
    total_load = 0.0
    for count in settings.counts:
        total_load += state.load_up_to(count)
        result = results[count]
        result.slora_setup_s = total_load
        result.slora_prepare_s, result.slora_register_s = state.prepare_s, state.register_s
        result.slora_runs = run_slora(state.llm, loads[count], settings.device)
        logger.info("slora at %d adapters: %s s", count, [round(r.seconds, 2) for r in result.slora_runs])
        if on_count is not None:
            on_count([results[c].row() for c in settings.counts if results[c].slora_runs])


def run_sweep(settings: Settings, workdir: Path, on_count: Callable[[ModelSetup, list[dict[str, Any]]], None] | None
              = None) -> tuple[ModelSetup, list[dict[str, Any]]]:
    setup = prepare_model(settings.device, workdir)
    max_count = max(settings.counts)
    paths = write_adapters(workdir / "adapters", setup, adapter_ranks(max_count, settings.rank_mix),
                           settings.targets)
    loads = {c: workload(settings, c, setup.vocab_size) for c in settings.counts}
    results = {c: CountResult(c, len({r.adapter for r in w.trace}), len(w.trace),
                              sum(r.output_len for r in w.trace)) for c, w in loads.items()}
    torch.manual_seed(settings.seed)
    if settings.skip_peft:
        for result in results.values():
            result.peft_status = "not run (--skip-peft)"
    else:
        peft = PeftState(setup, paths)       # PEFT first: on a GPU it must be gone before slora sizes its pool
        try:
            peft_sweep(peft, settings, loads, results)
        finally:
            peft.close()
    engine = SloraState(setup, paths, settings)
    try:
        slora_sweep(engine, settings, loads, results, on_count and (lambda rows: on_count(setup, rows)))
    finally:
        engine.close()
    return setup, [results[c].row() for c in settings.counts]


# ---- output -----------------------------------------------------------------------------------------------
def kept_ratio(rows: list[dict[str, Any]], low: int = 5) -> dict[str, Any] | None:
    """slora's requests/s at the largest count against that at `low` adapters."""
    by_count = {r["num_adapters"]: r for r in rows}
    high = max(by_count)
    if low not in by_count or high == low:
        return None
    return {"from": low, "to": high, "ratio": by_count[high]["slora_req_s"] / by_count[low]["slora_req_s"]}


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def show(value: Any) -> Any:
        return "-" if value is None else value
    return [{"adapters": r["num_adapters"], "distinct": r["distinct_adapters"],
             "slora_req_s": r["slora_req_s"], "slora_tok_s": r["slora_tok_s"],
             "peft_req_s": show(r["peft_req_s"]), "peft_tok_s": show(r["peft_tok_s"]),
             "speedup": show(r["speedup_req_s"]), "slora_setup_s": r["slora_setup_s"],
             "peft_setup_s": show(r["peft_setup_s"]), "decode_TB_s": show(r["slora_decode_tb_s"]),
             "decode_share": show(r["slora_decode_time_share"])} for r in rows]


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax_req, ax_tok) = plt.subplots(1, 2, figsize=(11, 4))
    counts = [r["num_adapters"] for r in rows]
    for ax, key, label in ((ax_req, "req_s", "requests/s"), (ax_tok, "tok_s", "output tokens/s")):
        ax.plot(counts, [r[f"slora_{key}"] for r in rows], "o-", label="slora")
        peft = [(c, r[f"peft_{key}"]) for c, r in zip(counts, rows) if r[f"peft_{key}"] is not None]
        if peft:
            ax.plot(*zip(*peft), "s--", label="transformers + PEFT")
        ax.set_xscale("log")
        ax.set_xlabel("number of adapters")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, dpi=120)


def payload(settings: Settings, setup: ModelSetup, rows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    scaled = settings.length_range != SLORA_LENGTHS
    return {
        "benchmark": "throughput", "device": settings.device, "quick": settings.quick, "model": setup.description,
        "trace": {"generator": "workloads.slora_trace", "num_requests": settings.num_requests,
                  "length_range": list(settings.length_range), "lengths_scaled_down": scaled,
                  "note": ("input and output lengths scaled down from S-LoRA's [8, 512] for the CPU" if scaled
                           else "S-LoRA's lengths"),
                  "arrivals": "all requests available at time 0 (offline)", "cv": settings.cv,
                  "alpha": settings.alpha, "rank_mix": settings.rank_mix, "seed": settings.seed},
        "adapters": {"targets": list(settings.targets), "ranks": "mixed {8,16,32,64}" if settings.rank_mix else 8},
        "peft_batch": settings.peft_batch, "slora_max_num_seqs": settings.max_num_seqs,
        "peft_budget_s": settings.peft_budget_s, "repeats": settings.repeats,
        "method": {
            "peft": "one PeftModel, all adapters loaded; arrival order, batches of up to peft_batch, left-padded "
                    "with attention mask, mixed adapter_names, greedy generate with max_new_tokens = min_new_tokens "
                    "= the batch's longest output; tokens counted per row up to the row's own output length",
            "slora": "one LLM, all adapters registered; all requests submitted at once, greedy, ignore_eos, "
                     "max_tokens = the request's output length",
            "timing": "loading excluded; per count one warm-up batch (the trace's first requests with other "
                      "prompts, 4 new tokens), then `repeats` timed runs of the whole trace, each with fresh "
                      "prompts; throughput = requests (output tokens) / mean run time; adapters are added to the "
                      "same PeftModel / engine as the count grows",
            "setup_s": "cumulative seconds to build the model / engine and load the adapters up to that count",
            "engine_extras": "the tiny model's engine also registers its 3 demo adapters (unused by the trace)"
                             if not setup.dummy else "",
        },
        "peft_measured_at": [r["num_adapters"] for r in rows if r["peft_req_s"] is not None],
        "peft_not_measured_at": [r["num_adapters"] for r in rows if r["peft_req_s"] is None],
        "slora_kept": kept_ratio(rows),
        "wall_seconds": seconds,
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI): counts 1,5,20, 24 requests")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--counts", default=None, help="comma-separated adapter counts (default 1,5,100,1000,2000)")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--lengths", default=None, help="LOW,HIGH input and output lengths")
    parser.add_argument("--rank-mix", action="store_true", help="ranks drawn from {8,16,32,64} (default: all 8)")
    parser.add_argument("--targets", default=",".join(ATTENTION), help="comma-separated modules, or 'all'")
    parser.add_argument("--peft-batch", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--host-cache-gib", type=float, default=None,
                        help="slora's adapter_host_cache_gib (default: the engine's)")
    parser.add_argument("--skip-peft", action="store_true", help="slora only (PEFT reported as not run)")
    parser.add_argument("--peft-budget-s", type=float, default=None, help="seconds PEFT may spend loading adapters")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per count, each with fresh prompts "
                        "(default 2, 1 with --quick); throughput is from their mean time")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("slora", "httpx", "transformers", "peft"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    settings = settings_from_args(args)
    start = time.perf_counter()
    out = Path(args.out or RESULTS / f"throughput_{'cpu' if settings.device == 'cpu' else 'gpu'}.json")

    def write_partial(setup: ModelSetup, rows: list[dict[str, Any]]) -> None:
        # A run cut short by a time limit still leaves every count it finished.
        write_json(out, {**payload(settings, setup, rows, time.perf_counter() - start), "partial": True})

    with tempfile.TemporaryDirectory(prefix="slora-throughput-") as tmp:
        setup, rows = run_sweep(settings, Path(tmp), write_partial)
    print_table(table_rows(rows))
    data = payload(settings, setup, rows, time.perf_counter() - start)
    write_json(out, {**data, "partial": False})
    kept = data["slora_kept"]
    if kept:
        logger.info("slora keeps %.1f%% of its requests/s from %d to %d adapters", 100 * kept["ratio"],
                    kept["from"], kept["to"])
    plot(rows, out.with_suffix(".png"), f"{setup.description}; {settings.num_requests} requests, lengths "
         f"{list(settings.length_range)}, {settings.device}")


if __name__ == "__main__":
    main()
