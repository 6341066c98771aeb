"""The FP8 KV cache: capacity and decode throughput, a BF16 cache against an FP8 (E4M3) one, slora against
vLLM 0.26.0 (`kv_cache_dtype="fp8"` in both).

  capacity   the tokens the KV pages hold at gpu_memory_utilization 0.9 (slora: `pool_stats()
             ["kv_token_capacity"]`; vLLM: `cache_config.num_gpu_blocks * block_size`)
  decode     where the cache dominates: a Llama-3-8B-shaped model with random bf16 weights, 256 sequences at
             4,096 and at 8,192 tokens of context, no adapter, prefix cache off, greedy, `ignore_eos`

Decode is measured apart from prefill the same way for both systems (neither exposes the other's step timers): for
each context C, 256 prompts of C random token ids with max_tokens=1 (T1: their prefill), then 256 other prompts of
C tokens with max_tokens=1+D (T2; D = --decode-tokens, 128 by default): decode tok/s = 256*D/(T2-T1), and the
second run's generated tok/s = 256*(1+D)/T2. A step's 8,192 prompt tokens admit 8,192 / C sequences and each runs D
+ 1 steps, so at most (8,192 / C) * (D + 1) run at once: D = 128 lets that reach what an FP8 cache fits on an 80 GB
card at both contexts (D = 64 held a 4,096-token run to 130 sequences). Prompts come from a seed per context and
run, the same for both systems, so no run reuses another's. One engine per (system, cache dtype), built once,
serves both contexts (max_model_len = the longest context + D + 1, max_num_seqs 256, max_num_batched_tokens 8,192
for both); a warm-up (a few short requests, then a few at each context), uncounted, runs before the timed runs.
`seqs_fit` = min(256, capacity // (C + D)): the sequences whose pages fit at once; slora also gives the peak number
it ran at once, and its preemptions. The roofline of a decode step at that concurrency: bytes = the weights a step
reads + the running sequences' KV (2 * layers * kv_heads * head_dim * bytes per element a token, at the mean
context C + D/2), over the HBM bandwidth of the device's name (H100 SXM 3.35 TB/s, H200 4.8 TB/s). The model
folder's config.json is Llama-3-8B's with max_position_embeddings 16,384, so that 8,192-token prompts fit; slora
calibrates its FP8 scales at start (--kv-cache-scales, the default "calibrate"), vLLM uses 1.0.

One (system, dtype) per process, each writing its JSON; the vLLM mode imports only vLLM, torch and the standard
library (run it under vLLM's PYTHONPATH); --table combines the JSONs:

    python benchmarks/kv_cache.py --system slora --kv-cache-dtype auto|fp8 [--model-dir DIR] [--out FILE]
    PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python benchmarks/kv_cache.py --system vllm --kv-cache-dtype auto|fp8 --model-dir DIR [--out FILE]
    python benchmarks/kv_cache.py --table RUN.json ... [--out FILE]    # FILE and FILE with .txt
    python benchmarks/kv_cache.py --write-model DIR                    # the model folder alone

    options of a run: [--contexts 4096,8192] [--num-seqs 256] [--decode-tokens 64] [--max-batched-tokens 8192]
                      [--gpu-memory-utilization 0.9] [--kv-cache-scales calibrate]

--quick: slora on the CPU, slora-tiny-llama, 4 sequences at contexts 64 and 128, D = 4 (the smoke test).
Default outputs: results/<machine kind>/kv_cache_<system>_<dtype>.json, and kv_cache.json/.txt for --table.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import random
import re
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger("benchmarks.kv_cache")
RESULTS = Path(__file__).resolve().parent / "results"
SEED = 42
SYSTEMS = ("slora", "vllm")
CACHE_DTYPES = ("auto", "fp8")
# Positions of the benchmark's model folder: Llama-3-8B's 8,192 is too few for an 8,192-token prompt and its decode.
MODEL_POSITIONS = 16384
# HBM bandwidth by device name, first match (lower case); get_device_properties does not give it.
HBM_BANDWIDTH = (("h100 pcie", 2.0e12), ("h100 nvl", 3.9e12), ("h100", 3.35e12), ("h200", 4.8e12))
# The goals of the issue: FP8 over BF16 decode where BF16 runs out of pages, and slora's FP8 over vLLM's.
FP8_GOAL = 1.6


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""
    contexts: tuple[int, ...]
    num_seqs: int
    decode_tokens: int
    warm_up_seqs: int                 # requests of the warm-up, short and at each context
    max_batched_tokens: int
    gpu_memory_utilization: float

    @property
    def max_model_len(self) -> int:
        """The longest request: the longest context, then 1 + D tokens generated."""
        return max(self.contexts) + self.decode_tokens + 1

    def check(self) -> None:
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"contexts must be positive, got {self.contexts}")
        if self.num_seqs < 1 or self.decode_tokens < 1 or self.warm_up_seqs < 1:
            raise ValueError("num_seqs, decode_tokens and warm_up_seqs must be >= 1")
        if self.max_model_len > MODEL_POSITIONS:
            raise ValueError(f"context + decode tokens + 1 = {self.max_model_len} exceeds the model folder's "
                             f"{MODEL_POSITIONS} positions")


FULL = Plan(contexts=(4096, 8192), num_seqs=256, decode_tokens=128, warm_up_seqs=8, max_batched_tokens=8192,
            gpu_memory_utilization=0.9)
QUICK = Plan(contexts=(64, 128), num_seqs=4, decode_tokens=4, warm_up_seqs=2, max_batched_tokens=2048,
             gpu_memory_utilization=0.9)


# ---- output (the standard library only: the vLLM mode shares it) ------------------------------------------
def save_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), **payload}, indent=2) + "\n")
    logger.info("wrote %s", path)


def machine_kind_of(device_name: str) -> str:
    """The results folder of a machine, as common.machine_kind names it: cpu, h100, h200, or the GPU's name."""
    name = device_name.lower()
    if name.startswith("cpu"):
        return "cpu"
    for kind in ("h100", "h200"):
        if kind in name:
            return kind
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "gpu"


def hbm_bandwidth(device_name: str) -> float | None:
    """Bytes/s of the device's HBM by its name; None for a CPU or an unknown GPU."""
    name = device_name.lower()
    return next((bandwidth for key, bandwidth in HBM_BANDWIDTH if key in name), None)


def long_context_config(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "max_position_embeddings": max(int(raw["max_position_embeddings"]), MODEL_POSITIONS)}


# ---- the roofline of a decode step --------------------------------------------------------------------------
def head_dim(raw: dict[str, Any]) -> int:
    return int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])


def kv_bytes_per_token(raw: dict[str, Any], element_bytes: int) -> int:
    """K and V of one token over every layer."""
    return 2 * int(raw["num_hidden_layers"]) * int(raw["num_key_value_heads"]) * head_dim(raw) * element_bytes


def decode_weight_bytes(raw: dict[str, Any], element_bytes: int) -> int:
    """The weights a decode step reads: every layer's projections and norms, the final norm and lm_head (the
    input embedding table only by the batch's rows, unless tied to lm_head)."""
    h, i = int(raw["hidden_size"]), int(raw["intermediate_size"])
    q = int(raw["num_attention_heads"]) * head_dim(raw)
    kv = int(raw["num_key_value_heads"]) * head_dim(raw)
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return (int(raw["num_hidden_layers"]) * layer + h + int(raw["vocab_size"]) * h) * element_bytes


@dataclass(frozen=True)
class Roofline:
    weight_bytes: int
    kv_bytes_per_token: int
    bandwidth: float | None           # bytes/s; None: no bound

    def bound(self, concurrency: int | None, context: int, decode_tokens: int) -> dict[str, float | None]:
        """The decode step's bytes at `concurrency` sequences of mean context C + D/2, and the tok/s bound."""
        if not concurrency or self.bandwidth is None:
            return {"roofline_step_ms": None, "roofline_decode_tok_s": None}
        step_bytes = self.weight_bytes + concurrency * (context + decode_tokens / 2) * self.kv_bytes_per_token
        step_s = step_bytes / self.bandwidth
        return {"roofline_step_ms": 1e3 * step_s, "roofline_decode_tok_s": concurrency / step_s}


# ---- the engines ----------------------------------------------------------------------------------------------
class Engine(Protocol):
    system: str

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        """Greedy, ignore_eos: the tokens generated for each prompt."""

    def synchronize(self) -> None: ...

    def capacity_tokens(self) -> int | None: ...

    def counters(self) -> dict[str, Any]:
        """What the last generate showed beside its time (peak sequences running, preemptions), where readable."""


@dataclass(frozen=True)
class Built:
    """An engine and what the JSON says of it."""
    engine: Engine
    engine_kwargs: dict[str, Any]
    raw: dict[str, Any]               # the model's config.json
    model: str                        # its description
    model_element_bytes: int
    cache_dtype: str                  # the KV cache's torch dtype
    device_name: str
    version: str | None


class SloraLLM:
    """slora's offline LLM as a side-by-side script drives it (beam_search.py's too): built once, its steps
    watched (`_note`, after each), synchronized before a clock reads."""
    system = "slora"

    def __init__(self, model: str, kwargs: dict[str, Any]) -> None:
        from common import after_each_step

        from slora import LLM

        self.llm = LLM(model, **kwargs)
        self.cuda = self.llm.config.device != "cpu"
        self.peak_running = 0
        self.preemptions_before = 0
        after_each_step(self.llm, self._note)

    def _note(self, engine: Any) -> None:
        """How many sequences run after a step: the peak of a call."""
        self.peak_running = max(self.peak_running, len(engine.scheduler.running))

    def synchronize(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()


class SloraEngine(SloraLLM):

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        from slora import SamplingParams
        from slora.core.step_stats import StepStats

        engine = self.llm.engine
        self.peak_running, self.preemptions_before = 0, engine.scheduler.num_preemptions
        engine.step_stats = StepStats()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return [len(output.outputs[0].token_ids) for output in self.llm.generate(prompts, params)]

    def capacity_tokens(self) -> int | None:
        return int(self.llm.pool_stats()["kv_token_capacity"])

    def counters(self) -> dict[str, Any]:
        engine = self.llm.engine
        return {"peak_running": self.peak_running,
                "preemptions": engine.scheduler.num_preemptions - self.preemptions_before,
                "slora_steps": engine.step_stats.as_dict()}


def build_slora(args: argparse.Namespace, plan: Plan, workdir: Path) -> Built:
    """slora on the benchmark's model: the 8B shape with dummy weights on CUDA (its folder written to
    --model-dir, or a temporary one), slora-tiny-llama on the CPU (--quick)."""
    from common import machine, prepare_model, write_config

    device = "cpu" if args.quick else "cuda"
    setup = prepare_model(device, workdir)
    if setup.dummy:
        raw = long_context_config(setup.raw)
        setup = replace(setup, folder=write_config(Path(args.model_dir) if args.model_dir else setup.folder, raw),
                        raw=raw, description=f"{setup.description}, max_position_embeddings {MODEL_POSITIONS}")
    kwargs: dict[str, Any] = {
        "device": device, **({"load_format": "dummy"} if setup.dummy else {}),
        "max_num_seqs": plan.num_seqs, "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": plan.max_batched_tokens, "enable_prefix_caching": False,
        "kv_cache_dtype": args.kv_cache_dtype, "kv_cache_scales": args.kv_cache_scales, "seed": SEED,
        **({"gpu_memory_utilization": plan.gpu_memory_utilization} if device != "cpu" else {})}
    from slora.models.builtin import TINY_MODEL

    engine = SloraEngine(str(setup.folder) if setup.dummy else TINY_MODEL, kwargs)
    config = engine.llm.config
    cache = config.torch_kv_cache_dtype or config.torch_dtype
    return Built(engine, kwargs, setup.raw, setup.description, setup.dtype.itemsize, str(cache).removeprefix("torch."),
                 machine(), package_version("slora"))


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


class VllmEngine:
    system = "vllm"

    def __init__(self, kwargs: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(**kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [len(output.outputs[0].token_ids) for output in outputs]

    def synchronize(self) -> None:
        """The model runs in vLLM's engine process; generate returns once its tokens are back."""

    def capacity_tokens(self) -> int | None:
        return vllm_capacity_tokens(self.llm)

    def counters(self) -> dict[str, Any]:
        return {"peak_running": None, "preemptions": None}


def vllm_capacity_tokens(llm: Any) -> int | None:
    """The KV tokens of vLLM's cache: the front end's cache_config.num_gpu_blocks * block_size (which the V1
    engine copies from its engine process once started), else its kv_cache_size_tokens; None, logged, when
    neither is there (vLLM's own log says "GPU KV cache size: N tokens")."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
    except AttributeError as err:
        logger.warning("vLLM's cache_config is not where expected (%s): capacity not recorded", err)
        return None
    blocks, block_size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    if blocks and block_size:
        return int(blocks) * int(block_size)
    tokens = getattr(cache, "kv_cache_size_tokens", None)
    if tokens:
        return int(tokens)
    logger.warning("vLLM's cache_config has no num_gpu_blocks: capacity not recorded (see vLLM's log line "
                   "'GPU KV cache size: N tokens')")
    return None


def build_vllm(args: argparse.Namespace, plan: Plan) -> Built:
    import torch
    import vllm

    folder = Path(args.model_dir)
    raw = json.loads((folder / "config.json").read_text())
    kwargs: dict[str, Any] = {
        "model": str(folder), "load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16",
        "gpu_memory_utilization": plan.gpu_memory_utilization, "max_num_seqs": plan.num_seqs,
        "max_model_len": plan.max_model_len, "max_num_batched_tokens": plan.max_batched_tokens,
        "enable_prefix_caching": False, "kv_cache_dtype": args.kv_cache_dtype, "seed": SEED}
    engine = VllmEngine(kwargs)
    cache = "float8_e4m3fn" if args.kv_cache_dtype == "fp8" else "bfloat16"
    return Built(engine, kwargs, raw, "Llama-3-8B-shaped, random bfloat16 weights (load_format=dummy), "
                 f"max_position_embeddings {raw['max_position_embeddings']}", 2, cache,
                 torch.cuda.get_device_name(0), vllm.__version__)


# ---- the timed runs ---------------------------------------------------------------------------------------------
def prompt_seed(context: int, phase: int) -> int:
    """A seed per context and run (0: warm-up, 1: the prefill run, 2: the decode run); the same for both systems."""
    return SEED * 1_000_000 + 10 * context + phase


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = range(3, min(vocab_size, 128000) - 1)
    return [rng.choices(ids, k=length) for _ in range(count)]


def timed_generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds of one generate call, every prompt checked to have produced max_tokens tokens."""
    engine.synchronize()
    start = time.perf_counter()
    produced = engine.generate(prompts, max_tokens)
    engine.synchronize()
    elapsed = time.perf_counter() - start
    short = [n for n in produced if n != max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} requests produced other than {max_tokens} tokens, e.g. {short[0]}")
    return elapsed


def warm_up(engine: Engine, plan: Plan, vocab_size: int) -> float:
    """A few short requests, then a few at each context (its prefill, mixed and decode steps), uncounted:
    no kernel meets a shape for the first time in a timed run."""
    start = time.perf_counter()
    timed_generate(engine, random_prompts(plan.warm_up_seqs, 32, vocab_size, prompt_seed(0, 0)), 4)
    for context in plan.contexts:
        timed_generate(engine, random_prompts(plan.warm_up_seqs, context, vocab_size, prompt_seed(context, 0)), 4)
    return time.perf_counter() - start


def seqs_fit(capacity: int | None, plan: Plan, context: int) -> int | None:
    """Sequences whose pages fit at once by the end of their decode (C + D tokens each)."""
    return None if capacity is None else min(plan.num_seqs, capacity // (context + plan.decode_tokens))


def measure_context(engine: Engine, plan: Plan, context: int, vocab_size: int, capacity: int | None,
                    roofline: Roofline) -> dict[str, Any]:
    n, d = plan.num_seqs, plan.decode_tokens
    t1 = timed_generate(engine, random_prompts(n, context, vocab_size, prompt_seed(context, 1)), 1)
    t2 = timed_generate(engine, random_prompts(n, context, vocab_size, prompt_seed(context, 2)), 1 + d)
    if t2 <= t1:
        logger.warning("context %d: T2 %.3f s <= T1 %.3f s: no decode rate", context, t2, t1)
    decode = n * d / (t2 - t1) if t2 > t1 else None
    fit = seqs_fit(capacity, plan, context)
    row = {"context": context, "num_seqs": n, "decode_tokens": d, "t1_s": t1, "t2_s": t2, "decode_s": t2 - t1,
           "decode_tok_s": decode, "gen_tok_s": n * (1 + d) / t2, "seqs_fit": fit, **engine.counters(),
           **roofline.bound(fit, context, d)}
    bound = row["roofline_decode_tok_s"]
    row["pct_roofline"] = 100 * decode / bound if decode and bound else None
    logger.info("%s, context %d: T1 %.2f s, T2 %.2f s, decode %s tok/s, %s sequences fit", engine.system, context, t1,
                t2, f"{decode:,.0f}" if decode else "-", fit)
    return row


def run(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """One (system, dtype): the engine, its warm-up, then each context; the JSON rewritten after each."""
    with tempfile.TemporaryDirectory(prefix="slora-kv-cache-") as tmp:
        start = time.perf_counter()
        built = build_slora(args, plan, Path(tmp)) if args.system == "slora" else build_vllm(args, plan)
        return measure(args, plan, built, start)


def measure(args: argparse.Namespace, plan: Plan, built: Built, start: float) -> dict[str, Any]:
    engine, start_s = built.engine, time.perf_counter() - start
    capacity = engine.capacity_tokens()
    element = 1 if "float8" in built.cache_dtype else built.model_element_bytes
    roofline = Roofline(decode_weight_bytes(built.raw, built.model_element_bytes),
                        kv_bytes_per_token(built.raw, element), hbm_bandwidth(built.device_name))
    kind = machine_kind_of(built.device_name)
    out = Path(args.out) if args.out else RESULTS / kind / f"kv_cache_{args.system}_{args.kv_cache_dtype}.json"
    logger.info("%s, kv_cache_dtype %s (%s): %s KV tokens; started in %.1f s", args.system, args.kv_cache_dtype,
                built.cache_dtype, f"{capacity:,}" if capacity else "unknown", start_s)
    data: dict[str, Any] = {
        "benchmark": "kv_cache", "system": args.system, "version": built.version, "quick": args.quick,
        "kv_cache_dtype": args.kv_cache_dtype, "cache_dtype": built.cache_dtype, "machine": built.device_name,
        "machine_kind": kind, "model": built.model, "config": built.raw, "engine": built.engine_kwargs,
        "plan": {**asdict(plan), "max_model_len": plan.max_model_len}, "capacity_tokens": capacity,
        "kv_bytes_per_token": roofline.kv_bytes_per_token, "decode_weight_bytes": roofline.weight_bytes,
        "hbm_bandwidth_bytes_per_s": roofline.bandwidth, "start_s": start_s, "method": METHOD, "rows": []}

    def save(partial: bool) -> None:
        save_json(out, {**data, "wall_seconds": time.perf_counter() - start, "partial": partial})

    vocab_size = int(built.raw["vocab_size"])
    data["warm_up_s"] = warm_up(engine, plan, vocab_size)
    for context in plan.contexts:
        data["rows"].append(measure_context(engine, plan, context, vocab_size, capacity, roofline))
        save(partial=True)
    save(partial=False)
    return data


METHOD = ("per context C: 256 prompts of C random ids with max_tokens=1 (T1), then 256 other prompts with "
          "max_tokens=1+D (T2); decode_tok_s = n*D/(T2-T1), gen_tok_s = n*(1+D)/T2; greedy, ignore_eos, prefix "
          "cache off, one engine for every context after an uncounted warm-up; seqs_fit = min(n, capacity // "
          "(C + D)); roofline = seqs_fit / ((decode weight bytes + seqs_fit * (C + D/2) * KV bytes a token) / HBM "
          "bandwidth)")


# ---- the combined table -------------------------------------------------------------------------------------------
RunKey = tuple[str, str]               # (system, kv_cache_dtype)


def load_runs(paths: list[Path]) -> dict[RunKey, dict[str, Any]]:
    """The runs' JSONs by (system, dtype), in SYSTEMS x CACHE_DTYPES order; a later file replaces an earlier one
    of the same pair, and a file that is not a run of this script is skipped."""
    runs: dict[RunKey, dict[str, Any]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("benchmark") != "kv_cache" or "system" not in data:
            logger.warning("%s is not a kv_cache run: skipped", path)
            continue
        key = (data["system"], data["kv_cache_dtype"])
        if key in runs:
            logger.warning("%s replaces an earlier %s %s run", path, *key)
        runs[key] = data
    return {key: runs[key] for key in sorted(runs, key=lambda k: (SYSTEMS.index(k[0]), CACHE_DTYPES.index(k[1])))}


def decode_at(run: dict[str, Any] | None, context: int) -> float | None:
    if run is None:
        return None
    return next((row["decode_tok_s"] for row in run["rows"] if row["context"] == context), None)


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def contexts_of(runs: dict[RunKey, dict[str, Any]]) -> list[int]:
    return sorted({row["context"] for run in runs.values() for row in run["rows"]})


def table_rows(runs: dict[RunKey, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: capacity, and per context T1, T2, decode tok/s, fp8 over auto of the same system (fp8
    rows), slora over vLLM of the same dtype (slora rows)."""
    rows = []
    for (system, dtype), run in runs.items():
        row: dict[str, Any] = {"system": system, "cache": run["cache_dtype"], "capacity_tokens": run["capacity_tokens"]}
        for context in contexts_of(runs):
            found = next((r for r in run["rows"] if r["context"] == context), None)
            mine = decode_at(run, context)
            row[f"T1_{context}"] = found["t1_s"] if found else None
            row[f"T2_{context}"] = found["t2_s"] if found else None
            row[f"decode_{context}"] = mine
            row[f"fp8/auto_{context}"] = ratio(mine, decode_at(runs.get((system, "auto")), context)) \
                if dtype == "fp8" else None
            row[f"slora/vllm_{context}"] = ratio(mine, decode_at(runs.get(("vllm", dtype)), context)) \
                if system == "slora" else None
        rows.append(row)
    return rows


def roofline_rows(runs: dict[RunKey, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run and context: the sequences that fit, the peak running (slora), the decode rates against the
    roofline at that concurrency, and the second run's generated tok/s."""
    return [{"system": system, "cache": run["cache_dtype"], "context": row["context"], "seqs_fit": row["seqs_fit"],
             "peak_running": row.get("peak_running"), "preemptions": row.get("preemptions"),
             "gen_tok_s": row["gen_tok_s"], "decode_tok_s": row["decode_tok_s"],
             "roofline_tok_s": row["roofline_decode_tok_s"], "pct_roofline": row["pct_roofline"]}
            for (system, _), run in runs.items() for row in run["rows"]]


def goal_rows(runs: dict[RunKey, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals per context: FP8 >= 1.6x the 16-bit cache's decode where that one runs out of pages
    (fewer sequences fit than run), per system; slora's FP8 ahead of vLLM's."""
    goals = []
    for context in contexts_of(runs):
        for system in SYSTEMS:
            auto, fp8 = runs.get((system, "auto")), runs.get((system, "fp8"))
            if auto is None or fp8 is None:
                continue
            fit = next((row["seqs_fit"] for row in auto["rows"] if row["context"] == context), None)
            out_of_pages = fit is not None and fit < auto["plan"]["num_seqs"]
            value = ratio(decode_at(fp8, context), decode_at(auto, context))
            goals.append({"context": context, "goal": f"{system} fp8/auto >= {FP8_GOAL}", "value": value,
                          "met": None if value is None or not out_of_pages else value >= FP8_GOAL,
                          "note": f"auto fits {fit}" + ("" if out_of_pages else ": not out of pages, not judged")})
        if ("slora", "fp8") in runs and ("vllm", "fp8") in runs:
            value = ratio(decode_at(runs["slora", "fp8"], context), decode_at(runs["vllm", "fp8"], context))
            goals.append({"context": context, "goal": "slora fp8/vllm fp8 > 1", "value": value,
                          "met": None if value is None else value > 1, "note": ""})
    return goals


def render(tables: list[list[dict[str, Any]]]) -> str:
    """The tables as print_table writes them, one after the other."""
    from common import print_table

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        for rows in tables:
            print_table(rows)
            print()  # noqa: T201 - a blank line between the tables
    return text.getvalue()


def machines_of(runs: dict[Any, dict[str, Any]]) -> list[str]:
    """The machines the runs ran on (a warning when they are several: compare rows of one machine)."""
    machines = sorted({run["machine"] for run in runs.values()})
    if len(machines) > 1:
        logger.warning("the runs come from different machines (%s): compare rows of one machine", machines)
    return machines


def table_out(runs: dict[Any, dict[str, Any]], name: str, out: Path | None) -> Path:
    """Where a combined table goes: `out`, or results/<the runs' machine kind>/<name>.json."""
    return out or RESULTS / sorted({run.get("machine_kind", "gpu") for run in runs.values()})[0] / f"{name}.json"


def publish(data: dict[str, Any], tables: list[list[dict[str, Any]]], out: Path) -> dict[str, Any]:
    """Print the tables, and write `data` to `out` and the tables (under the machines) beside it as .txt."""
    text = render(tables)
    print(text, end="")  # noqa: T201 - the tables are the mode's output
    save_json(out, data)
    out.with_suffix(".txt").write_text(f"{', '.join(data['machines'])}\n\n{text}")
    logger.info("wrote %s", out.with_suffix(".txt"))
    return data


def write_table(paths: list[Path], out: Path | None) -> dict[str, Any]:
    runs = load_runs(paths)
    if not runs:
        raise SystemExit("no kv_cache run among the files given")
    data = {"benchmark": "kv_cache", "machines": machines_of(runs), "runs": [str(p) for p in paths],
            "rows": table_rows(runs), "roofline": roofline_rows(runs), "goals": goal_rows(runs),
            "method": METHOD, "engines": {f"{s} {d}": run["engine"] for (s, d), run in runs.items()},
            "versions": {s: run.get("version") for (s, _), run in runs.items()}}
    return publish(data, [data["rows"], data["roofline"], data["goals"]], table_out(runs, "kv_cache", out))


# ---- the command line ------------------------------------------------------------------------------------------
def positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, sorted and without repeats."""
    try:
        values = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def joined(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--system", choices=SYSTEMS, help="run one engine in this process")
    mode.add_argument("--table", nargs="+", type=Path, metavar="FILE", help="combine the runs' JSONs")
    mode.add_argument("--write-model", type=Path, metavar="DIR", help="write the model folder (config.json) only")
    parser.add_argument("--kv-cache-dtype", choices=CACHE_DTYPES, default="auto")
    parser.add_argument("--quick", action="store_true", help="slora on the CPU, the tiny model, small sizes")
    parser.add_argument("--contexts", type=positive_ints, default=None,
                        help=f"prompt lengths (default {joined(FULL.contexts)}; quick {joined(QUICK.contexts)})")
    parser.add_argument("--num-seqs", type=int, default=None, help=f"sequences per run (default {FULL.num_seqs})")
    parser.add_argument("--decode-tokens", type=int, default=None,
                        help=f"D, the tokens decoded after the first (default {FULL.decode_tokens})")
    parser.add_argument("--max-batched-tokens", type=int, default=None,
                        help=f"tokens in one step, both systems (default {FULL.max_batched_tokens})")
    parser.add_argument("--gpu-memory-utilization", type=float, default=FULL.gpu_memory_utilization)
    parser.add_argument("--kv-cache-scales", default="calibrate",
                        help="slora's FP8 scales: calibrate (the default, as served), ones, ...")
    return parse_run_args(parser, argv)


def parse_run_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The options every side-by-side script ends with (--model-dir, --out), parsed and checked: vLLM runs on
    a GPU only, over a model folder that a slora run or --write-model wrote."""
    parser.add_argument("--model-dir", default=None,
                        help="the model folder: slora writes it there (default: a temporary one); vLLM reads it")
    parser.add_argument("--out", default=None, help="the JSON (--table: also its .txt beside it)")
    args = parser.parse_args(argv)
    if args.system == "vllm" and args.quick:
        parser.error("--quick runs slora on the CPU only")
    if args.system == "vllm" and not (args.model_dir and (Path(args.model_dir) / "config.json").is_file()):
        parser.error("--system vllm needs --model-dir holding config.json (written by a slora run or --write-model)")
    return args


def plan_of(args: argparse.Namespace) -> Plan:
    base = QUICK if args.quick else FULL
    plan = replace(base, contexts=args.contexts or base.contexts, num_seqs=args.num_seqs or base.num_seqs,
                   decode_tokens=args.decode_tokens or base.decode_tokens,
                   max_batched_tokens=args.max_batched_tokens or base.max_batched_tokens,
                   gpu_memory_utilization=args.gpu_memory_utilization)
    plan.check()
    return plan


def write_model(folder: Path) -> None:
    from common import LLAMA3_8B, write_config

    write_config(folder, long_context_config(LLAMA3_8B))
    logger.info("wrote %s", folder / "config.json")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("slora").setLevel(logging.WARNING)
    for name in ("slora.kv_scales", "slora.sizing"):        # the calibrated scales and the pool's size
        logging.getLogger(name).setLevel(logging.INFO)
    if args.write_model:
        write_model(args.write_model)
    elif args.table:
        write_table(args.table, Path(args.out) if args.out else None)
    else:
        run(args, plan_of(args))


if __name__ == "__main__":
    main()
