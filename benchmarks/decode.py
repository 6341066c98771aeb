"""Decode step of a Llama-3-8B-shaped model (random bf16 weights) on the GPU, against the roofline.

Step time at batch 1, 16, 64, 128, 256 with context 1,024: no adapter, all requests on one rank-16
adapter, each request on its own rank-16 adapter (all seven projections). Roofline time = max(bytes /
4.24 TB/s, FLOPs / 810 TFLOP/s), bytes = weights + live KV + each distinct adapter once.
With --vs-peft: end-to-end generation (prompt 128, 64 new tokens, batch 64, 32 rank-16 adapters) of
slora against transformers + PEFT on the same GPU, in the same run. --profile: GPU time by kernel of one
eager decode step; --mixed: eager mixed steps (decoding sequences beside prefills) timed and profiled;
--host-profile: cProfile of the host side of such steps. --sampling-cost: the decode step at batch 64 with
the sampler (temperature 1) on the host's side of it, with 0, 50 and 100% of the requests asking for logprobs
(top 5) or for JSON-schema output (xgrammar masks; --tokenizer DIR, default: the default model's).

    python benchmarks/decode.py [--quick] [--vs-peft | --profile | --mixed | --host-profile | --sampling-cost]
                                [--out FILE]
"""
import argparse
import dataclasses
import gc
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import MappingProxyType

import torch
from common import (
    COPY_BANDWIDTH,
    LLAMA3_8B,
    PROJECTIONS,
    default_out,
    print_table,
    projection_features,
    write_config,
    write_json,
    write_peft_adapter,
)

from slora.adapters.config import AdapterConfig
from slora.adapters.packing import AdapterDescriptor, buffer_layout
from slora.adapters.shapes import TargetShapes
from slora.adapters.weights import LoadedAdapter, LoraWeights
from slora.config import CudaConfig
from slora.core.page_pool import PageAllocator
from slora.core.scheduler import ScheduledSeq
from slora.core.sequence import AdapterRef, BlockTable, Sequence
from slora.execution.cuda_graphs import GraphLimits
from slora.execution.in_flight import HostCopy
from slora.execution.lora_backend import LoraLaunchPolicy
from slora.execution.model_runner import ModelRunner
from slora.execution.pool_memory import PoolShape
from slora.kernels.layout import cdiv
from slora.models.builtin import DEFAULT_MODEL, resolve_model
from slora.models.config import parse_model_config
from slora.models.llama import LORA_LAYERS_PREFIX, LORA_MODULE_PATHS
from slora.models.loader import random_model
from slora.models.tokenizer import eos_token_ids, load_tokenizer
from slora.sampling.engine_grammars import EngineGrammars
from slora.sampling.params import SamplingParams
from slora.sampling.sampler import Sampler
from slora.sampling.structured_output import StructuredOutput

BF16_FLOPS = 810e12
CONTEXT, RANK = 1024, 16
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2          # Llama-3-8B: layers * (K, V) * kv_heads * head_dim * bf16
# Adapter mixes of a decode step: no adapter, one adapter shared by every request, one per request.
MIXES = ("none", "shared", "distinct")
# Requests per adapter of the mixes that spread requests over adapters; pairs and quads, run only when
# --mixes names them, give decode steps whose LoRA blocks have 2 or 4 tokens.
REQUESTS_PER_ADAPTER = MappingProxyType({"distinct": 1, "pairs": 2, "quads": 4})
ALL_MIXES = ("none", "shared", *REQUESTS_PER_ADAPTER)


def adapter_index(mode: str, request: int) -> int:
    """Which of the placed adapters request `request` of a step of this mix uses (not for "none")."""
    return 0 if mode == "shared" else request // REQUESTS_PER_ADAPTER[mode]


def distinct_adapters(mode: str, batch: int) -> int:
    """How many adapters a step of this mix and batch size uses."""
    if mode in REQUESTS_PER_ADAPTER:
        return cdiv(batch, REQUESTS_PER_ADAPTER[mode])
    return int(mode == "shared")


# Command-line help for the fields of LoraLaunchPolicy that get a flag (--field-name, the field's default).
POLICY_HELP = {
    "accumulate_max_tokens": "steps of at most this many tokens shrink into one h",
    "accumulate_max_slots": "... and steps with at most this many adapter slots",
    "accumulate_few_max_tokens": "... of at most this many tokens",
    "block_m_tokens_per_slot": "64-token blocks from this many tokens per adapter slot",
    "gemv_expand_min_tokens": "one-token expand kernel in steps of a slot per token from this many tokens",
}


def weight_bytes(raw: dict = LLAMA3_8B) -> int:
    """bf16 bytes of every weight (layers, input embedding, lm_head): 16.06 GB for Llama-3-8B."""
    cfg = parse_model_config(raw)
    layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    return 2 * (cfg.num_layers * layer + 2 * cfg.vocab_size * cfg.hidden_size)


def decode_weight_bytes(batch: int, raw: dict = LLAMA3_8B) -> int:
    """Weight bytes a decode step reads: every weight but the input embedding table, of which only the
    batch's rows (15.01 GB + batch rows for Llama-3-8B, against the 15.0 GB measured on the H200)."""
    cfg = parse_model_config(raw)
    return weight_bytes(raw) - 2 * cfg.vocab_size * cfg.hidden_size + 2 * batch * cfg.hidden_size


def adapter_bytes(rank: int, raw: dict = LLAMA3_8B) -> int:
    """bf16 bytes of a rank-r adapter on all seven projections of every layer (80 MiB at rank 16)."""
    features = projection_features(raw)
    return 2 * raw["num_hidden_layers"] * sum(rank * sum(features[m]) for m in PROJECTIONS)


def rank16_descriptor(rank: int) -> tuple[AdapterDescriptor, int]:
    """The pool layout of a rank-r adapter on all seven projections (weights are filled on the GPU)."""
    features = projection_features()
    shapes = TargetShapes(LLAMA3_8B["num_hidden_layers"], tuple((m, features[m]) for m in PROJECTIONS),
                          tuple(LORA_MODULE_PATHS[m] for m in PROJECTIONS), LORA_LAYERS_PREFIX)
    weights = {(l, m): LoraWeights(torch.empty(rank, 0), torch.empty(0, rank), 2.0)
               for l in range(shapes.num_layers) for m in PROJECTIONS}
    config = AdapterConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS)
    return buffer_layout(LoadedAdapter(config, weights, "layout"), shapes)


def make_runner(max_batch: int, num_adapters: int, page_size: int = 16, max_loras: int | None = None,
                few_adapters: int = 0, pdl: bool = True, lora_policy: LoraLaunchPolicy = LoraLaunchPolicy(),
                side_stream: bool = True):
    cfg = parse_model_config(LLAMA3_8B)
    model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
    descriptor, elems = rank16_descriptor(RANK)
    template = PoolShape(cfg.num_layers, 0, page_size, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    adapter_pages = -(-elems // template.page_elems)
    kv_pages = max_batch * (CONTEXT // page_size + 1)
    shape = template.with_pages(kv_pages + num_adapters * adapter_pages)
    limits = GraphLimits(max_batch, CONTEXT // page_size + 1, adapter_pages, RANK, cfg.num_layers, len(PROJECTIONS),
                         max_loras, few_adapters=few_adapters, lora_side_stream=side_stream)
    runner = ModelRunner(model, shape, torch.device("cuda"), limits, pdl=pdl, lora_policy=lora_policy)
    return runner, descriptor, adapter_pages


def build_step(runner: ModelRunner, allocator: PageAllocator, batch: int, adapters: list[tuple[str, list[int]]],
               descriptor: AdapterDescriptor, mode: str) -> tuple[list[ScheduledSeq], dict]:
    seqs, step_adapters = [], {}
    for i in range(batch):
        ref = None
        if mode != "none":
            version, pages = adapters[adapter_index(mode, i)]
            ref = AdapterRef(version, len(pages))
            step_adapters[version] = (descriptor, pages)
        seq = Sequence(i, f"r{i}", [1] * (CONTEXT - 1), SamplingParams(max_tokens=2), ref)
        seq.output_token_ids.append(1)
        seq.num_computed_tokens = CONTEXT - 1
        seq.block_table = BlockTable(allocator.allocate_kv_pages(CONTEXT // runner.shape.page_size))
        seqs.append(ScheduledSeq(seq, 1))
    return seqs, step_adapters


def place_adapters(runner: ModelRunner, allocator: PageAllocator, count: int,
                   adapter_pages: int) -> list[tuple[str, list[int]]]:
    """`count` rank-16 adapters' pages in the pool, filled with small random weights: (version, pages)."""
    adapters = []
    for i in range(count):
        pages = allocator.allocate_adapter(f"adapter-{i}", adapter_pages)
        for weights in runner.memory.views.weights:                         # [pages, page_elems] per layer
            weights[pages] = torch.randn(len(pages), weights.shape[1], device="cuda", dtype=weights.dtype) * 0.01
        adapters.append((f"adapter-{i}", pages))
    return adapters


def release_kv(allocator: PageAllocator, scheduled: list[ScheduledSeq]) -> None:
    for item in scheduled:
        allocator.release_kv_pages(item.seq.block_table)


def time_steps(runner: ModelRunner, scheduled, adapters, iters: int) -> float:
    for _ in range(3):
        runner.run(scheduled, adapters)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        runner.run(scheduled, adapters)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def roofline_seconds(batch: int, distinct_adapters: int) -> float:
    cfg = parse_model_config(LLAMA3_8B)
    bytes_read = decode_weight_bytes(batch) + batch * CONTEXT * KV_BYTES_PER_TOKEN + \
        distinct_adapters * adapter_bytes(RANK)
    flops = 2 * weight_bytes() / 2 * batch + 4 * batch * CONTEXT * cfg.num_layers * cfg.q_size
    return max(bytes_read / COPY_BANDWIDTH, flops / BF16_FLOPS)


def step_rows(batches: list[int], iters: int, max_loras: int | None = None, few_adapters: int = 0,
              pdl: bool = True, lora_policy: LoraLaunchPolicy = LoraLaunchPolicy(),
              mixes: tuple[str, ...] = MIXES, side_stream: bool = True) -> list[dict]:
    """Decode steps per batch size and adapter mix; with max_loras the graphs have that many adapter slots,
    and the distinct mix runs only at batches that fit it."""
    max_batch = max(batches)
    runner, descriptor, adapter_pages = make_runner(max_batch, max_batch, max_loras=max_loras,
                                                    few_adapters=few_adapters, pdl=pdl, lora_policy=lora_policy,
                                                    side_stream=side_stream)
    allocator = PageAllocator(runner.shape.num_pages, runner.shape.page_size)
    adapters = place_adapters(runner, allocator, max_batch, adapter_pages)
    rows = []
    for batch in batches:
        for mode in mixes:
            if max_loras is not None and distinct_adapters(mode, batch) > max_loras:
                continue
            scheduled, step_adapters = build_step(runner, allocator, batch, adapters, descriptor, mode)
            seconds = time_steps(runner, scheduled, step_adapters, iters)
            release_kv(allocator, scheduled)
            roof = roofline_seconds(batch, distinct_adapters(mode, batch))
            rows.append({"batch": batch, "adapters": mode, "step_ms": seconds * 1e3,
                         "tok_s": batch / seconds, "roofline_ms": roof * 1e3, "pct_roofline": 100 * roof / seconds})
    return rows


def kernel_profile(batch: int, top: int = 30) -> list[dict]:
    """GPU time by kernel of one eager decode step per adapter mix (torch.profiler): which launches a
    step spends its time in. Eager, because a graph replay hides its kernels from some profilers."""
    from torch.profiler import ProfilerActivity, profile

    runner, allocator, adapters, descriptor = eager_setup(batch, batch)
    rows = []
    for mode in ("none", "shared", "distinct"):
        scheduled, step_adapters = build_step(runner, allocator, batch, adapters, descriptor, mode)
        time_steps(runner, scheduled, step_adapters, 2)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.run(scheduled, step_adapters)
            torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events)
        # Events with GPU time: kernels and copies (the runtime's launch calls are events too, without).
        launches = sum(e.count for e in events if e.device_time_total > 0)
        print(f"{mode}: {launches} kernels, {total / 1e3:.2f} ms of GPU time")  # noqa: T201 - the report
        rows += [{"adapters": mode, "kernel": e.key[:70], "count": e.count, "total_us": e.device_time_total,
                  "mean_us": e.device_time_total / e.count} for e in events[:top]]
        release_kv(allocator, scheduled)
    return rows


MIXED_PREFILLS = (280, 280)   # a mixed step of the throughput trace: ~600 tokens, 64 of them decoding


def eager_setup(batch: int, num_adapters: int) -> tuple[ModelRunner, PageAllocator, list, AdapterDescriptor]:
    """A runner without decode graphs (every step eager) and `num_adapters` rank-16 adapters in its pool, with
    KV pages for `batch` decoding sequences and the mixed steps' prefills."""
    runner, descriptor, adapter_pages = make_runner(batch + len(MIXED_PREFILLS), num_adapters)
    runner.graphs = None
    allocator = PageAllocator(runner.shape.num_pages, runner.shape.page_size)
    return runner, allocator, place_adapters(runner, allocator, num_adapters, adapter_pages), descriptor


def mixed_step(runner: ModelRunner, allocator: PageAllocator, adapters: list[tuple[str, list[int]]],
               descriptor: AdapterDescriptor, batch: int, num_adapters: int) -> tuple[list[ScheduledSeq], dict]:
    """A mixed step: `batch` decoding sequences at context CONTEXT and MIXED_PREFILLS new prompts, every
    sequence on adapter `i % num_adapters`."""
    scheduled, step_adapters = build_step(runner, allocator, batch, adapters, descriptor, "distinct")
    for item in scheduled:
        version, pages = adapters[item.seq.seq_id % num_adapters]
        item.seq.adapter = AdapterRef(version, len(pages))
    for j, length in enumerate(MIXED_PREFILLS):
        version, pages = adapters[(batch + j) % num_adapters]
        seq = Sequence(batch + j, f"p{j}", [2] * length, SamplingParams(max_tokens=2), AdapterRef(version, len(pages)))
        seq.block_table = BlockTable(allocator.allocate_kv_pages(cdiv(length, runner.shape.page_size)))
        scheduled.append(ScheduledSeq(seq, length))
    used = {item.seq.adapter.version for item in scheduled}
    return scheduled, {v: (descriptor, pages) for v, pages in adapters if v in used}


def host_rows(runner: ModelRunner, scheduled: list[ScheduledSeq], step_adapters: dict, iters: int,
              label: str) -> list[dict]:
    """Host time of a step: building its inputs, and returning from run() before the GPU is waited for
    (the whole step if something inside synchronises)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        runner.inputs_for(scheduled, step_adapters)
    inputs = (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.run(scheduled, step_adapters)
    enqueue = time.perf_counter() - start
    torch.cuda.synchronize()
    return [{"mix": label, "kernel": "(host) inputs_for", "count": iters, "total_us": inputs * 1e6},
            {"mix": label, "kernel": "(host) run() returns after", "count": 1, "total_us": enqueue * 1e6}]


def mixed_rows(batch: int, iters: int, top: int = 12) -> list[dict]:
    """Eager mixed steps (decode graphs do not cover them) on 5 adapters and on one adapter per sequence,
    the latter also with every LoRA block forced to 64 tokens: step time and the GPU time of the top
    kernels (the throughput benchmark's mixed steps took 44.7 ms at 5 adapters, 57.7 ms at 2,000)."""
    count = batch + len(MIXED_PREFILLS)
    runner, allocator, adapters, descriptor = eager_setup(batch, count)
    rows, policy = [], runner.lora.policy
    # 64-token blocks from one token per adapter slot: every block of the step is 64 tokens.
    blocks_64 = dataclasses.replace(policy, block_m_tokens_per_slot=1)
    try:
        for label, num_adapters, step_policy in (("5 adapters", 5, policy), ("distinct", count, policy),
                                                 ("distinct, block_m 64", count, blocks_64)):
            runner.lora.policy = step_policy
            scheduled, step_adapters = mixed_step(runner, allocator, adapters, descriptor, batch, num_adapters)
            rows += mixed_step_rows(runner, scheduled, step_adapters, iters, top, label)
            release_kv(allocator, scheduled)
    finally:
        runner.lora.policy = policy
    return rows


def mixed_step_rows(runner: ModelRunner, scheduled: list[ScheduledSeq], step_adapters: dict, iters: int, top: int,
                    label: str) -> list[dict]:
    """One mix's rows: wall time of the step, its host rows, the host's synchronisations and its top kernels."""
    from torch.profiler import ProfilerActivity, profile

    seconds = time_steps(runner, scheduled, step_adapters, iters)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        runner.run(scheduled, step_adapters)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: -e.device_time_total)[:top]
    rows = [{"mix": label, "kernel": "(whole step, wall)", "count": 1, "total_us": seconds * 1e6}]
    rows += host_rows(runner, scheduled, step_adapters, iters, label)
    rows += [{"mix": label, "kernel": f"(host) {e.key[:50]}", "count": e.count, "total_us": e.cpu_time_total}
             for e in averages if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")]
    return rows + [{"mix": label, "kernel": e.key[:60], "count": e.count, "total_us": e.device_time_total}
                   for e in events]


def host_profile(batch: int) -> str:
    """cProfile of the host side of three eager mixed steps on one adapter per sequence: where run() spends
    its Python time (the mixed steps are bound by the host, mixed_rows)."""
    import cProfile
    import io
    import pstats

    runner, allocator, adapters, descriptor = eager_setup(batch, batch + len(MIXED_PREFILLS))
    scheduled, step_adapters = mixed_step(runner, allocator, adapters, descriptor, batch, len(adapters))
    time_steps(runner, scheduled, step_adapters, 3)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        runner.run(scheduled, step_adapters)
    torch.cuda.synchronize()
    profiler.disable()
    report = io.StringIO()
    pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(40)
    return report.getvalue()


def peft_tokens_per_s(folder: Path, adapters: list[Path], prompts: torch.Tensor, new_tokens: int) -> float:
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="a0")
    for i, path in enumerate(adapters[1:], start=1):
        model.load_adapter(str(path), adapter_name=f"a{i}")
    names = [f"a{i % len(adapters)}" for i in range(prompts.shape[0])]
    ids = prompts.cuda()
    with torch.inference_mode():
        model.generate(input_ids=ids[:, :8], adapter_names=names, max_new_tokens=2, do_sample=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    del model
    return prompts.shape[0] * new_tokens / elapsed


def slora_tokens_per_s(folder: Path, adapters: list[Path], prompts: torch.Tensor,
                       new_tokens: int) -> tuple[float, dict[str, object]]:
    """slora's tokens/s, and its step statistics (time by step kind) of the timed run."""
    from slora import LLM
    from slora.core.step_stats import StepStats

    llm = LLM(str(folder), device="cuda", load_format="dummy", max_num_seqs=prompts.shape[0],
              max_lora_rank=RANK, max_model_len=1024)
    for i, path in enumerate(adapters):
        llm.load_adapter(f"a{i}", str(path))
    names = [f"a{i % len(adapters)}" for i in range(prompts.shape[0])]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    # Warm-up like PEFT's: the full batch (other prompts of the same length, so the timed run has no
    # prefix-cache hit), a few tokens: compiles every kernel variant the timed run needs.
    warm = (prompts + 1).clamp(max=127999).tolist()
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), adapters=names)
    llm.engine.step_stats = StepStats()
    start = time.perf_counter()
    outputs = llm.generate(prompts.tolist(), params, adapters=names)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outputs)
    stats = {**llm.engine.step_stats.as_dict(), "wall_seconds": elapsed}
    del llm
    return prompts.shape[0] * new_tokens / elapsed, stats


def vs_peft(batch: int, num_adapters: int, new_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config(Path(tmp) / "llama8b")
        adapters = [write_peft_adapter(Path(tmp) / f"a{i}", LLAMA3_8B, RANK, PROJECTIONS, seed=i, dtype=torch.float16,
                                       scale=0.01) for i in range(num_adapters)]
        prompts = torch.randint(3, 128000, (batch, 128), generator=torch.Generator().manual_seed(42))
        peft = peft_tokens_per_s(folder, adapters, prompts, new_tokens)
        gc.collect()
        torch.cuda.empty_cache()
        ours, steps = slora_tokens_per_s(folder, adapters, prompts, new_tokens)
    return {"batch": batch, "adapters": num_adapters, "prompt": 128, "new_tokens": new_tokens,
            "peft_tok_s": peft, "slora_tok_s": ours, "ratio": ours / peft, "slora_steps": steps}


# A bounded schema: sampled under its mask from random weights it still ends within a few dozen tokens.
PERSON_SCHEMA = '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, ' \
                '"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}'
SAMPLING_FEATURES = ("logprobs", "json_schema")
ROUNDS = 5                     # turns of the sampling-cost cases


def feature_params(feature: str, seed: int) -> SamplingParams:
    if feature == "logprobs":
        return SamplingParams(max_tokens=2, temperature=1.0, seed=seed, logprobs=5)
    if feature == "json_schema":
        return SamplingParams(max_tokens=2, temperature=1.0, seed=seed,
                              structured=StructuredOutput("json_schema", PERSON_SCHEMA))
    return SamplingParams(max_tokens=2, temperature=1.0, seed=seed)


class SampledSteps:
    """Decode steps of one batch, each sampled like the engine does: each grammar row's token pushed to its
    grammar, which takes it while the next step's forward runs; a grammar that ends (its EOS) starts again,
    so every step masks. overlap: in the engine's overlapped order, the next forward is launched before the
    tokens of the step before are taken (its input ids are the host's, stale, which changes no timing).
    Host time is split into the launch, the take of the tokens before (their wait and pushes) and the
    sampling (a synchronous step's take comes after its sampling: it waits for the forward)."""

    def __init__(self, runner: ModelRunner, scheduled: list[ScheduledSeq], grammars: EngineGrammars,
                 features: list[str], eos: frozenset[int], overlap: bool = True) -> None:
        self.runner, self.scheduled, self.grammars, self.eos = runner, scheduled, grammars, eos
        self.overlap = overlap
        self.seqs = [item.seq for item in scheduled]
        for i, (seq, feature) in enumerate(zip(self.seqs, features)):
            seq.params = feature_params(feature, i)
        self.states = [self._fresh(seq) for seq in self.seqs]
        self.sampler = Sampler(eos)
        self.in_flight: HostCopy | None = None
        self.host = {"launch": 0.0, "take": 0.0, "sample": 0.0}    # seconds, summed over steps

    def _fresh(self, seq: Sequence):
        return None if seq.params.structured is None else self.grammars.start(seq.params.structured)

    def step(self) -> None:
        began = time.perf_counter()
        logits = self.runner.run(self.scheduled, {})
        launched = time.perf_counter()
        if self.overlap:
            self._take()
        taken = time.perf_counter()
        masker = self.grammars if any(s is not None for s in self.states) else None
        self.in_flight = HostCopy(self.sampler.on_device(logits, self.seqs, self.states, masker))
        if not self.overlap:
            self._take()
        self.host["launch"] += launched - began
        self.host["sample"] += time.perf_counter() - taken
        self.host["take"] += taken - launched

    def _take(self) -> None:
        """The tokens in flight, on the host: pushed to their grammars."""
        if self.in_flight is None:
            return
        result, self.in_flight = self.in_flight.result(), None
        for i, (state, token) in enumerate(zip(self.states, result.token_ids)):
            if state is None:
                continue
            if token in self.eos:
                self.states[i] = self._fresh(self.seqs[i])
            else:
                state.push(token)


def sampling_rows(batch: int, iters: int, tokenizer_dir: Path) -> list[dict]:
    """Step time with each feature on 0, 50 and 100% of the batch, against the plain sampled step, in the
    engine's overlapped order and in the synchronous one. The cases take turns, `ROUNDS` times, and each
    row gives the median over the rounds: one machine's drift then moves every case alike."""
    return [{"order": "overlapped" if overlap else "synchronous", **row}
            for overlap in (True, False) for row in sampling_mode_rows(batch, iters, tokenizer_dir, overlap)]


def sampling_mode_rows(batch: int, iters: int, tokenizer_dir: Path, overlap: bool) -> list[dict]:
    runner, descriptor, _ = make_runner(batch, 0)
    allocator = PageAllocator(runner.shape.num_pages, runner.shape.page_size)
    scheduled, _ = build_step(runner, allocator, batch, [], descriptor, "none")
    tokenizer = load_tokenizer(tokenizer_dir)
    eos = frozenset(eos_token_ids((), tokenizer))
    grammars = EngineGrammars(tokenizer, LLAMA3_8B["vocab_size"], eos)
    cases = [("none", 0.0)] + [(f, share) for f in SAMPLING_FEATURES for share in (0.5, 1.0)]
    timings: dict[tuple[str, float], list[float]] = {case: [] for case in cases}
    host: dict[tuple[str, float], dict[str, float]] = {}
    for _ in range(ROUNDS):
        for feature, share in cases:
            steps = SampledSteps(runner, scheduled, grammars, case_features(feature, share, batch), eos, overlap)
            timings[(feature, share)].append(time_calls(steps.step, iters))
            host[(feature, share)] = {k: v / (iters + 3) for k, v in steps.host.items()}
    busy = {case: gpu_busy_seconds(SampledSteps(runner, scheduled, grammars, case_features(*case, batch), eos,
                                                overlap).step)
            for case in cases}
    release_kv(allocator, scheduled)
    base = statistics.median(timings[cases[0]])
    return [{"batch": batch, "feature": feature, "share_pct": 100 * share,
             "step_ms": statistics.median(timings[(feature, share)]) * 1e3,
             "vs_none_pct": 100 * (statistics.median(timings[(feature, share)]) / base - 1),
             "gpu_busy_ms": busy[(feature, share)] * 1e3,
             **{f"host_{k}_ms": v * 1e3 for k, v in host[(feature, share)].items()}}
            for feature, share in cases]


def case_features(feature: str, share: float, batch: int) -> list[str]:
    users = int(batch * share)
    return [feature] * users + ["none"] * (batch - users)


def gpu_busy_seconds(step, iters: int = 5) -> float:
    """The GPU time of one step's kernels and copies (torch.profiler): against the step's wall time, what
    the GPU spends waiting for the host."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / iters


def time_calls(step, iters: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--vs-peft", action="store_true")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="capture the decode graphs with this many adapter slots (engine max_loras)")
    parser.add_argument("--graph-few-adapters", type=int, default=CudaConfig().graph_few_adapters,
                        help="steps with at most this many adapters replay graphs sized for that many (0: never)")
    parser.add_argument("--no-pdl", dest="pdl", action="store_false",
                        help="Triton kernels without programmatic dependent launch")
    parser.add_argument("--no-lora-side-stream", dest="side_stream", action="store_false",
                        help="the decode graphs add each LoRA after its base GEMM instead of computing it on a "
                             "second stream while the GEMM runs")
    modes.add_argument("--mixed", action="store_true",
                        help="eager mixed steps (64 decoding + 2 prefills) on 5 vs distinct adapters, by kernel")
    modes.add_argument("--host-profile", action="store_true",
                        help="cProfile of the host side of eager mixed steps (text report to --out or stdout)")
    modes.add_argument("--sampling-cost", action="store_true",
                       help="the batch-64 decode step with logprobs or JSON-schema output on 0/50/100%% of requests")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="with --sampling-cost: the HF tokenizer folder for the grammars (default: the "
                             "default model's)")
    modes.add_argument("--profile", action="store_true",
                        help="GPU time by kernel of one eager step at batch 64 (no roofline table)")
    parser.add_argument("--mixes", default=",".join(MIXES),
                        help=f"comma-separated subset of {','.join(ALL_MIXES)}")
    defaults = {field.name: field.default for field in dataclasses.fields(LoraLaunchPolicy)}
    for name, text in POLICY_HELP.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=defaults[name],
                            help=f"LoRA launch policy: {text}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    mixes = tuple(args.mixes.split(","))
    if not set(mixes) <= set(ALL_MIXES):
        parser.error(f"--mixes must name some of {', '.join(ALL_MIXES)}, got {args.mixes}")
    try:
        lora_policy = LoraLaunchPolicy(**{name: getattr(args, name) for name in POLICY_HELP})
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        logging.warning("decode.py measures the CUDA path: no GPU here, nothing to do")
        return
    torch.manual_seed(42)
    out = Path(args.out) if args.out else default_out("decode")
    if args.vs_peft:
        row = vs_peft(8 if args.quick else 64, 4 if args.quick else 32, 8 if args.quick else 64)
        print_table([{k: v for k, v in row.items() if k != "slora_steps"}])
        steps = row["slora_steps"]
        for kind, count in steps["steps"].items():
            print(f"slora {kind} steps: {count}, {steps['seconds'][kind]:.3f} s, {steps['tokens'][kind]} tokens")
        print(f"slowest step: {steps['slowest_seconds'] * 1e3:.1f} ms ({steps['slowest_kind']}); "
              f"wall {steps['wall_seconds']:.3f} s")
        write_json(out, {"benchmark": "decode-vs-peft", "rows": [row]})
        return
    if args.host_profile:
        report = host_profile(8 if args.quick else 64)
        if args.out:
            Path(args.out).write_text(report)
        else:
            sys.stdout.write(report)
        return
    if args.mixed:
        rows = mixed_rows(8 if args.quick else 64, 3 if args.quick else 10)
        print_table(rows)
        write_json(out, {"benchmark": "decode-mixed", "rows": rows})
        return
    if args.sampling_cost:
        folder = args.tokenizer or resolve_model(DEFAULT_MODEL).folder
        rows = sampling_rows(8 if args.quick else 64, 5 if args.quick else 20, folder)
        print_table(rows)
        write_json(out, {"benchmark": "decode-sampling-cost", "context": CONTEXT, "rows": rows})
        return
    if args.profile:
        rows = kernel_profile(8 if args.quick else 64)
        print_table(rows)
        write_json(out, {"benchmark": "decode-profile", "rows": rows})
        return
    rows = step_rows([1, 16] if args.quick else [1, 16, 64, 128, 256], 5 if args.quick else 20, args.max_loras,
                     args.graph_few_adapters, args.pdl, lora_policy, mixes, args.side_stream)
    print_table(rows)
    write_json(out, {"benchmark": "decode", "context": CONTEXT, "rank": RANK, "max_loras": args.max_loras,
                     "graph_few_adapters": args.graph_few_adapters, "pdl": args.pdl,
                     "lora_side_stream": args.side_stream, "lora_policy": dataclasses.asdict(lora_policy),
                     "rows": rows})


if __name__ == "__main__":
    main()
