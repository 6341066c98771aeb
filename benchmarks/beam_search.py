"""Beam-search throughput, slora's engine-level beam search against vLLM 0.26.0's `LLM.beam_search`.

The workload: a Llama-3-8B-shaped model with random bf16 weights; prompts of 128 and of 1,024 random token ids; 128
new tokens (ignore_eos, no stop); beam widths 4, 16 and 64, one best beam returned (n=1). For each (prompt length,
width): a warm-up call of a few requests (uncounted), then one timed call of R requests (16 by default), each a beam
search over its own prompt. Prompts come from a seed per (prompt length, width, phase), the same for both systems,
so no call meets prompts that an earlier one cached. Reported: requests/s, beam tokens/s (R * width * max_tokens /
seconds, the tokens the beams decoded) and seconds; for slora also the preemptions, the peak number of sequences
(beams) running at once and the peak KV pages in use (running beams sampled after every engine step, pages after
every schedule).

  slora   `LLM(..., max_beam_width=<widest>).generate(prompts, SamplingParams(use_beam_search=True, beam_width=k,
          n=1, max_tokens=T, ignore_eos=True))`; each beam counts as a sequence of max_num_seqs
  vLLM    `LLM(...).beam_search([{"prompt_token_ids": ids}, ...], BeamSearchParams(beam_width=k, max_tokens=T,
          ignore_eos=True))`: a loop in the front end that submits every live beam as a one-token request per
          step (logprobs=2k), so its engine needs max_logprobs >= 2 * the widest width

Both engines: max_num_seqs 256 (several 64-wide groups at once), max_model_len 2,048, max_num_batched_tokens
8,192, gpu_memory_utilization 0.9, prefix caching at each system's default (vLLM's beam search leans on it to
reuse a beam's history between its steps). vLLM's beam search reads the tokenizer's eos_token_id and decodes the
final beams, which a folder holding config.json alone cannot give; the vLLM mode writes a stand-in tokenizer (a
word-level vocabulary "t0" .. "t<vocab-1>", plain JSON) to a temporary folder and passes it as `tokenizer=`
(--vllm-skip-tokenizer builds vLLM with skip_tokenizer_init=True instead, should its beam search run without one).

One system per process, each writing its JSON after every (prompt length, width), so a run cut short keeps what
it measured; the vLLM mode imports only vLLM, torch and the standard library (run it under vLLM's PYTHONPATH);
--table combines the JSONs:

    python benchmarks/beam_search.py --system slora [--model-dir DIR] [--out FILE]
    PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python benchmarks/beam_search.py --system vllm --model-dir DIR [--out FILE]
    python benchmarks/beam_search.py --table RUN.json ... [--out FILE]    # FILE and FILE with .txt
    python benchmarks/beam_search.py --write-model DIR                    # the model folder alone

    options of a run: [--prompt-lens 128,1024] [--widths 4,16,64] [--requests 16] [--max-tokens 128]
                      [--warm-up-requests 2] [--max-num-seqs 256] [--max-model-len 2048]
                      [--max-batched-tokens 8192] [--gpu-memory-utilization 0.9]

--quick: slora on the CPU, slora-tiny-llama, prompts of 8 and 16 tokens, 4 new tokens, widths 2 and 4, 2 requests
(the smoke test). Default outputs: results/<machine kind>/beam_search_<system>.json, and beam_search.json/.txt
for --table.
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from kv_cache import (
    SloraLLM,
    joined,
    machine_kind_of,
    machines_of,
    package_version,
    parse_run_args,
    positive_ints,
    publish,
    random_prompts,
    ratio,
    save_json,
    table_out,
)

logger = logging.getLogger("benchmarks.beam_search")
RESULTS = Path(__file__).resolve().parent / "results"
SEED = 42
SYSTEMS = ("slora", "vllm")
# The goals: slora ahead of vLLM at every width, and at least 3x from width 16 on.
WIDE = 16
WIDE_GOAL = 3.0


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""
    prompt_lens: tuple[int, ...]
    widths: tuple[int, ...]
    requests: int                     # R, the requests of a timed call
    max_tokens: int
    warm_up_requests: int
    max_num_seqs: int
    max_model_len: int
    max_batched_tokens: int
    gpu_memory_utilization: float

    def check(self) -> None:
        if not self.prompt_lens or not self.widths:
            raise ValueError("prompt lengths and widths must not be empty")
        if min(self.requests, self.max_tokens, self.warm_up_requests, min(self.prompt_lens), min(self.widths)) < 1:
            raise ValueError("requests, max_tokens, warm-up requests, prompt lengths and widths must be >= 1")
        if max(self.prompt_lens) + self.max_tokens > self.max_model_len:
            raise ValueError(f"the longest prompt + max_tokens = {max(self.prompt_lens) + self.max_tokens} exceeds "
                             f"max_model_len {self.max_model_len}")
        # Every beam is a sequence: a group wider than max_num_seqs could never run.
        if max(self.widths) > self.max_num_seqs:
            raise ValueError(f"width {max(self.widths)} exceeds max_num_seqs {self.max_num_seqs}")


FULL = Plan(prompt_lens=(128, 1024), widths=(4, 16, 64), requests=16, max_tokens=128, warm_up_requests=2,
            max_num_seqs=256, max_model_len=2048, max_batched_tokens=8192, gpu_memory_utilization=0.9)
QUICK = Plan(prompt_lens=(8, 16), widths=(2, 4), requests=2, max_tokens=4, warm_up_requests=1,
             max_num_seqs=16, max_model_len=64, max_batched_tokens=2048, gpu_memory_utilization=0.9)


# ---- the engines ----------------------------------------------------------------------------------------------
class Engine(Protocol):
    system: str

    def beam_search(self, prompts: list[list[int]], width: int, max_tokens: int) -> list[int]:
        """One beam search per prompt (n=1, ignore_eos): the tokens its best beam generated."""

    def synchronize(self) -> None: ...

    def reset_counters(self) -> None: ...

    def counters(self) -> dict[str, Any]:
        """What the calls since reset_counters showed beside their time, where readable."""


@dataclass(frozen=True)
class Built:
    """An engine and what the JSON says of it."""
    engine: Engine
    engine_kwargs: dict[str, Any]
    raw: dict[str, Any]               # the model's config.json
    model: str                        # its description
    device_name: str
    version: str | None


class SloraEngine(SloraLLM):
    def __init__(self, model: str, kwargs: dict[str, Any]) -> None:
        from common import after_each_schedule

        self.peak_kv_pages = 0
        super().__init__(model, kwargs)
        after_each_schedule(self.llm, self._note_pages)

    def _note_pages(self, engine: Any) -> None:
        """The KV pages held once a step is scheduled, its peak. pool_stats is O(1), so sampling it every step
        costs nothing measurable."""
        self.peak_kv_pages = max(self.peak_kv_pages, int(engine.pool_stats()["kv_pages"]))

    def beam_search(self, prompts: list[list[int]], width: int, max_tokens: int) -> list[int]:
        from slora import SamplingParams

        params = SamplingParams(use_beam_search=True, beam_width=width, n=1, max_tokens=max_tokens, ignore_eos=True)
        return [len(output.outputs[0].token_ids) for output in self.llm.generate(prompts, params)]

    def reset_counters(self) -> None:
        self.peak_running = self.peak_kv_pages = 0
        self.preemptions_before = self.llm.engine.scheduler.num_preemptions

    def counters(self) -> dict[str, Any]:
        return {"preemptions": self.llm.engine.scheduler.num_preemptions - self.preemptions_before,
                "peak_running": self.peak_running, "peak_kv_pages": self.peak_kv_pages,
                "kv_pages_total": int(self.llm.pool_stats()["total_pages"])}


def build_slora(args: argparse.Namespace, plan: Plan, workdir: Path) -> Built:
    """slora on the benchmark's model: the 8B shape with dummy weights on CUDA (its folder written to
    --model-dir, or a temporary one), slora-tiny-llama on the CPU (--quick)."""
    from common import machine, prepare_model, write_config

    from slora.models.builtin import TINY_MODEL

    device = "cpu" if args.quick else "cuda"
    setup = prepare_model(device, workdir)
    if setup.dummy and args.model_dir:
        setup = replace(setup, folder=write_config(Path(args.model_dir), setup.raw))
    kwargs: dict[str, Any] = {
        "device": device, **({"load_format": "dummy"} if setup.dummy else {}),
        "max_num_seqs": plan.max_num_seqs, "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": plan.max_batched_tokens, "max_beam_width": max(plan.widths), "seed": SEED,
        **({"gpu_memory_utilization": plan.gpu_memory_utilization} if device != "cpu" else {})}
    engine = SloraEngine(str(setup.folder) if setup.dummy else TINY_MODEL, kwargs)
    return Built(engine, kwargs, setup.raw, setup.description, machine(), package_version("slora"))


class VllmEngine:
    system = "vllm"

    def __init__(self, kwargs: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(**kwargs)

    def beam_search(self, prompts: list[list[int]], width: int, max_tokens: int) -> list[int]:
        params = beam_search_params()(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
        # Positional: the signature read (prompts, params, lora_request=None, ...) may grow keywords by 0.26.0.
        outputs = self.llm.beam_search([{"prompt_token_ids": ids} for ids in prompts], params)
        return [best_beam_tokens(output, ids) for output, ids in zip(outputs, prompts, strict=True)]

    def synchronize(self) -> None:
        """The model runs in vLLM's engine process; beam_search returns once its beams are back."""

    def reset_counters(self) -> None:
        """vLLM's front end exposes neither preemptions nor pages per call."""

    def counters(self) -> dict[str, Any]:
        return {"preemptions": None, "peak_running": None, "peak_kv_pages": None, "kv_pages_total": None}


def beam_search_params() -> Any:
    """vLLM's BeamSearchParams: in vllm.sampling_params in the versions read; the package's top level as a
    fallback, should 0.26.0 have moved it."""
    try:
        from vllm.sampling_params import BeamSearchParams
    except ImportError:
        from vllm import BeamSearchParams
    return BeamSearchParams


def best_beam_tokens(output: Any, prompt: list[int]) -> int:
    """The tokens the best beam generated: vLLM's BeamSearchSequence.tokens holds the prompt and then the
    output (in the versions read); counted from the prompt's end if it starts with the prompt, else whole."""
    tokens = list(output.sequences[0].tokens)
    return len(tokens) - len(prompt) if tokens[:len(prompt)] == prompt else len(tokens)


def write_tokenizer(folder: Path, raw: dict[str, Any]) -> Path:
    """A stand-in tokenizer for the model's vocabulary (token i is the word "t<i>"), written as plain JSON so that
    the vLLM mode needs no tokenizers package of its own: vLLM's beam search reads eos_token_id and decodes."""
    vocab_size = int(raw["vocab_size"])
    word = {key: f"t{int(raw.get(key) or 0)}" for key in ("bos_token_id", "eos_token_id")}
    tokenizer: dict[str, Any] = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab_size)}, "unk_token": "t0"}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": word["bos_token_id"],
              "eos_token": word["eos_token_id"], "unk_token": "t0", "model_max_length": int(raw.get(
                  "max_position_embeddings", 2048))}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def build_vllm(args: argparse.Namespace, plan: Plan, workdir: Path) -> Built:
    import torch
    import vllm

    folder = Path(args.model_dir)
    raw = json.loads((folder / "config.json").read_text())
    tokenizer: dict[str, Any] = {"skip_tokenizer_init": True} if args.vllm_skip_tokenizer else \
        {"tokenizer": str(write_tokenizer(workdir / "tokenizer", raw))}
    kwargs: dict[str, Any] = {
        "model": str(folder), "load_format": "dummy", "dtype": "bfloat16", **tokenizer,
        "gpu_memory_utilization": plan.gpu_memory_utilization, "max_num_seqs": plan.max_num_seqs,
        "max_model_len": plan.max_model_len, "max_num_batched_tokens": plan.max_batched_tokens,
        # Each beam step asks for 2 * width logprobs; vLLM refuses more than max_logprobs (20 by default).
        "max_logprobs": 2 * max(plan.widths), "seed": SEED}
    return Built(VllmEngine(kwargs), kwargs, raw, "Llama-3-8B-shaped, random bfloat16 weights (load_format=dummy)",
                 torch.cuda.get_device_name(0), vllm.__version__)


# ---- the timed calls ------------------------------------------------------------------------------------------
def prompt_seed(prompt_len: int, width: int, phase: int) -> int:
    """A seed per (prompt length, width, phase: 0 warm-up, 1 timed); the same for both systems."""
    return SEED * 1_000_000_000 + prompt_len * 10_000 + width * 10 + phase


def timed_beam_search(engine: Engine, prompts: list[list[int]], width: int, max_tokens: int) -> float:
    """Seconds of one beam-search call, every best beam checked to have generated max_tokens tokens."""
    engine.synchronize()
    start = time.perf_counter()
    produced = engine.beam_search(prompts, width, max_tokens)
    engine.synchronize()
    elapsed = time.perf_counter() - start
    short = [n for n in produced if n != max_tokens]
    if len(produced) != len(prompts) or short:
        raise RuntimeError(f"{len(prompts)} beam searches gave {len(produced)} outputs, {len(short)} of other than "
                           f"{max_tokens} tokens (e.g. {short[:1]})")
    return elapsed


def measure_point(engine: Engine, plan: Plan, prompt_len: int, width: int, vocab_size: int) -> dict[str, Any]:
    """One (prompt length, width): the warm-up call, then the timed one."""
    warm = random_prompts(plan.warm_up_requests, prompt_len, vocab_size, prompt_seed(prompt_len, width, 0))
    warm_up_s = timed_beam_search(engine, warm, width, plan.max_tokens)
    engine.reset_counters()
    prompts = random_prompts(plan.requests, prompt_len, vocab_size, prompt_seed(prompt_len, width, 1))
    seconds = timed_beam_search(engine, prompts, width, plan.max_tokens)
    beam_tokens = plan.requests * width * plan.max_tokens
    row = {"prompt_len": prompt_len, "width": width, "requests": plan.requests, "max_tokens": plan.max_tokens,
           "seconds": seconds, "req_s": plan.requests / seconds, "beam_tokens": beam_tokens,
           "beam_tok_s": beam_tokens / seconds, "warm_up_s": warm_up_s, **engine.counters()}
    logger.info("%s, prompt %d, width %d: %.2f s, %.3f req/s, %.0f beam tok/s", engine.system, prompt_len, width,
                seconds, row["req_s"], row["beam_tok_s"])
    return row


def run(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """One system: its engine, then each (prompt length, width); the JSON rewritten after each."""
    with tempfile.TemporaryDirectory(prefix="slora-beam-search-") as tmp:
        start = time.perf_counter()
        built = build_slora(args, plan, Path(tmp)) if args.system == "slora" else build_vllm(args, plan, Path(tmp))
        return measure(args, plan, built, start)


def measure(args: argparse.Namespace, plan: Plan, built: Built, start: float) -> dict[str, Any]:
    start_s = time.perf_counter() - start
    kind = machine_kind_of(built.device_name)
    out = Path(args.out) if args.out else RESULTS / kind / f"beam_search_{args.system}.json"
    logger.info("%s on %s: started in %.1f s", args.system, built.device_name, start_s)
    data: dict[str, Any] = {
        "benchmark": "beam_search", "system": args.system, "version": built.version, "quick": args.quick,
        "machine": built.device_name, "machine_kind": kind, "model": built.model, "config": built.raw,
        "engine": built.engine_kwargs, "plan": asdict(plan), "start_s": start_s, "method": METHOD, "rows": []}

    def save(partial: bool) -> None:
        save_json(out, {**data, "wall_seconds": time.perf_counter() - start, "partial": partial})

    vocab_size = int(built.raw["vocab_size"])
    for prompt_len in plan.prompt_lens:
        for width in plan.widths:
            data["rows"].append(measure_point(built.engine, plan, prompt_len, width, vocab_size))
            save(partial=True)
    save(partial=False)
    return data


METHOD = ("per (prompt length P, width k): a warm-up call of a few requests, uncounted, then one timed call of R "
          "requests, each a beam search (n=1, ignore_eos, no stop) of max_tokens T over its own P random token ids "
          "(seeded per P, k and phase; the same for both systems); req_s = R / seconds, beam_tok_s = R*k*T / "
          "seconds; slora's peaks sampled in every engine step of the timed call (pages once it is scheduled)")


# ---- the combined table -----------------------------------------------------------------------------------------
def load_runs(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """The runs' JSONs by system, in SYSTEMS order, a file that is not a run of this script skipped. Runs of one
    system merge (a long plan may run as several, each over some widths or prompt lengths): the later file's
    fields, and its row wherever two measured the same (prompt length, width)."""
    runs: dict[str, dict[str, Any]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("benchmark") != "beam_search" or data.get("system") not in SYSTEMS:
            logger.warning("%s is not a beam_search run: skipped", path)
            continue
        earlier = runs.get(data["system"], {"rows": []})
        runs[data["system"]] = {**data, "rows": merged_rows(earlier["rows"], data["rows"])}
    return {system: runs[system] for system in SYSTEMS if system in runs}


def merged_rows(earlier: list[dict[str, Any]], later: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Both runs' rows by (prompt length, width), the later's where both have one."""
    by_point = {(row["prompt_len"], row["width"]): row for row in [*earlier, *later]}
    return [by_point[point] for point in sorted(by_point)]


def row_at(run: dict[str, Any] | None, prompt_len: int, width: int) -> dict[str, Any]:
    if run is None:
        return {}
    return next((row for row in run["rows"] if row["prompt_len"] == prompt_len and row["width"] == width), {})


def goal_of(width: int) -> float:
    """The slora/vLLM requests/s a width must reach: ahead (> 1) below width 16, 3x from 16 on."""
    return WIDE_GOAL if width >= WIDE else 1.0


def table_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (prompt length, width) that any run measured: both systems' requests/s and beam tokens/s side
    by side, slora/vLLM, slora's preemptions and peak KV pages, and the goal at that width."""
    points = sorted({(row["prompt_len"], row["width"]) for run in runs.values() for row in run["rows"]})
    rows = []
    for prompt_len, width in points:
        slora, vllm = row_at(runs.get("slora"), prompt_len, width), row_at(runs.get("vllm"), prompt_len, width)
        value, goal = ratio(slora.get("req_s"), vllm.get("req_s")), goal_of(width)
        rows.append({"prompt_len": prompt_len, "width": width, "requests": slora.get("requests", vllm.get("requests")),
                     "slora_req_s": slora.get("req_s"), "vllm_req_s": vllm.get("req_s"), "slora/vllm": value,
                     "slora_beam_tok_s": slora.get("beam_tok_s"), "vllm_beam_tok_s": vllm.get("beam_tok_s"),
                     "slora_s": slora.get("seconds"), "vllm_s": vllm.get("seconds"),
                     "slora_preemptions": slora.get("preemptions"), "slora_peak_kv_pages": slora.get("peak_kv_pages"),
                     "goal": f"> {goal:g}" if goal == 1.0 else f">= {goal:g}",
                     "met": None if value is None else (value > goal if goal == 1.0 else value >= goal)})
    return rows


def write_table(paths: list[Path], out: Path | None) -> dict[str, Any]:
    runs = load_runs(paths)
    if not runs:
        raise SystemExit("no beam_search run among the files given")
    data: dict[str, Any] = {
        "benchmark": "beam_search", "machines": machines_of(runs), "runs": [str(p) for p in paths],
        "rows": table_rows(runs), "method": METHOD, "engines": {system: run["engine"] for system, run in runs.items()},
        "versions": {system: run.get("version") for system, run in runs.items()},
        "partial": {system: run.get("partial") for system, run in runs.items()}}
    return publish(data, [data["rows"]], table_out(runs, "beam_search", out))


# ---- the command line -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--system", choices=SYSTEMS, help="run one engine in this process")
    mode.add_argument("--table", nargs="+", type=Path, metavar="FILE", help="combine the runs' JSONs")
    mode.add_argument("--write-model", type=Path, metavar="DIR", help="write the model folder (config.json) only")
    parser.add_argument("--quick", action="store_true", help="slora on the CPU, the tiny model, small sizes")
    parser.add_argument("--prompt-lens", type=positive_ints, default=None,
                        help=f"prompt lengths (default {joined(FULL.prompt_lens)}; quick {joined(QUICK.prompt_lens)})")
    parser.add_argument("--widths", type=positive_ints, default=None,
                        help=f"beam widths (default {joined(FULL.widths)}; quick {joined(QUICK.widths)})")
    parser.add_argument("--requests", type=int, default=None, help=f"R, requests per timed call (default "
                                                                     f"{FULL.requests}; quick {QUICK.requests})")
    parser.add_argument("--max-tokens", type=int, default=None, help=f"new tokens per beam (default "
                                                                       f"{FULL.max_tokens}; quick {QUICK.max_tokens})")
    parser.add_argument("--warm-up-requests", type=int, default=None,
                        help=f"requests of each warm-up call (default {FULL.warm_up_requests})")
    parser.add_argument("--max-num-seqs", type=int, default=None, help=f"both systems (default {FULL.max_num_seqs})")
    parser.add_argument("--max-model-len", type=int, default=None, help=f"both systems (default {FULL.max_model_len})")
    parser.add_argument("--max-batched-tokens", type=int, default=None,
                        help=f"tokens in one step, both systems (default {FULL.max_batched_tokens})")
    parser.add_argument("--gpu-memory-utilization", type=float, default=FULL.gpu_memory_utilization)
    parser.add_argument("--vllm-skip-tokenizer", action="store_true",
                        help="build vLLM with skip_tokenizer_init=True instead of the stand-in tokenizer")
    return parse_run_args(parser, argv)


def plan_of(args: argparse.Namespace) -> Plan:
    base = QUICK if args.quick else FULL
    overrides = {"prompt_lens": args.prompt_lens, "widths": args.widths, "requests": args.requests,
                 "max_tokens": args.max_tokens, "warm_up_requests": args.warm_up_requests,
                 "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
                 "max_batched_tokens": args.max_batched_tokens}
    plan = replace(base, **{key: value for key, value in overrides.items() if value is not None},
                   gpu_memory_utilization=args.gpu_memory_utilization)
    plan.check()
    return plan


def write_model(folder: Path) -> None:
    from common import LLAMA3_8B, write_config

    write_config(folder, LLAMA3_8B)
    logger.info("wrote %s", folder / "config.json")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("slora").setLevel(logging.WARNING)
    if args.write_model:
        write_model(args.write_model)
    elif args.table:
        write_table(args.table, Path(args.out) if args.out else None)
    else:
        run(args, plan_of(args))


if __name__ == "__main__":
    main()
