"""The quality an FP8 KV cache keeps on SmolLM2-135M-Instruct in float32 on the CPU (the oracle setting), against
the float32 cache (kv_cache_dtype auto). Four engines, each built once: `auto`, `fp8` (calibrated scales),
`fp8` with the first and last layers kept in float32 (`kv_cache_dtype_skip_layers`), and `fp8` with every
scale 1.0. For each:

- greedy agreement with auto's outputs on 16 chat prompts, each on the base model and on every demo adapter
  (64 tokens at most, stopping at the end of the turn): the share of tokens equal position by position
  (`token_match`), of auto's tokens before each output's first difference (`prefix_match`), and of whole
  outputs identical (`identical`); and, under teacher forcing (auto's output appended to its prompt), the share
  of auto's tokens this cache also ranks first (`forced_top1`), which one early difference does not carry on;
- the perplexity of tests/data/kv_quality.txt in windows of 512 tokens, from prompt logprobs (every token after
  the first of each window), and its change against auto in percent;
- the KV tokens the same pool_gib holds (`kv_token_capacity`), and the calibrated scales' range.

`--quick` (the smoke test): auto and fp8, 2 prompts of 8 tokens, one window of 128 tokens. The full run takes
about 5 minutes on 2 cores.

    python benchmarks/kv_quality.py [--quick] [--out FILE]
"""
from __future__ import annotations

import argparse
import gc
import logging
import math
import time
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path
from typing import Any

from common import default_out, print_table, write_json

from slora import LLM, SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "kv_quality.txt"
ADAPTERS: tuple[str | None, ...] = (None, "demo-caps", "demo-json", "demo-pirate")
# Questions that ask for a few sentences, so most answers run to the token limit and every position is compared.
PROMPTS = (
    "Explain in a short paragraph why the sky is blue.",
    "Describe how a bicycle's gears make climbing a hill easier.",
    "What are three good habits for keeping a kitchen clean?",
    "Write a short story about a cat who finds a lost key.",
    "How does a refrigerator keep food cold? Answer in a few sentences.",
    "Give me some advice for a first job interview.",
    "Why do leaves change colour in autumn?",
    "Explain what a prime number is and give a few examples.",
    "Describe a pleasant walk along a river in spring.",
    "What is the difference between weather and climate?",
    "List some ways to save water at home and explain each briefly.",
    "How do airplanes stay in the air?",
    "Write a polite email asking a neighbour to turn down their music.",
    "What should someone pack for a weekend camping trip?",
    "Explain how to make a simple vegetable soup.",
    "Why is regular exercise good for the brain?",
)
POOL_GIB = 0.25          # the engine's default on the CPU: every configuration gets the same bytes
# The printed table's columns; the JSON's rows also name each configuration's options.
TABLE_KEYS = ("config", "token_match", "prefix_match", "identical", "forced_top1", "ppl", "ppl_delta_pct",
              "kv_token_capacity", "capacity_x", "scale_log2_min", "scale_log2_max", "seconds")


@dataclass(frozen=True)
class Sizes:
    prompts: int
    max_tokens: int
    window: int
    windows: int | None          # None: every window of the text
    every_adapter: bool          # each prompt on every adapter; else adapters round robin


FULL = Sizes(prompts=len(PROMPTS), max_tokens=64, window=512, windows=None, every_adapter=True)
QUICK = Sizes(prompts=2, max_tokens=8, window=128, windows=1, every_adapter=False)


@dataclass
class Measured:
    outputs: list[list[int]]
    ppl: float
    ppl_tokens: int                                      # the tokens scored
    kv_token_capacity: int
    forced_top1: float                                   # of auto's greedy tokens, under teacher forcing
    scales_log2: tuple[int, int] | None                  # the smallest and largest scale's exponent (FP8 only)
    seconds: float
    num_layers: int


def configurations(num_layers: int, quick: bool) -> dict[str, dict[str, Any]]:
    """Name -> LLM keywords of each cache under test."""
    configs: dict[str, dict[str, Any]] = {
        "auto": {},
        "fp8": {"kv_cache_dtype": "fp8"},
        f"fp8 skip 0,{num_layers - 1}": {"kv_cache_dtype": "fp8",
                                         "kv_cache_dtype_skip_layers": f"0,{num_layers - 1}"},
        "fp8 scales 1.0": {"kv_cache_dtype": "fp8", "kv_cache_scales": "ones"},
    }
    return dict(list(configs.items())[:2]) if quick else configs


def requests(sizes: Sizes) -> list[tuple[str, str | None]]:
    """(question, adapter) pairs: every prompt on every adapter, or the adapters round robin."""
    prompts = PROMPTS[:sizes.prompts]
    if sizes.every_adapter:
        return list(product(prompts, ADAPTERS))
    return [(prompt, ADAPTERS[i % len(ADAPTERS)]) for i, prompt in enumerate(prompts)]


def windows(token_ids: list[int], size: int, count: int | None = None) -> list[list[int]]:
    """The text cut into consecutive windows of `size` tokens (the last may be shorter; one of a single token
    scores nothing and is dropped), at most `count` of them."""
    if size < 2:
        raise ValueError(f"a window must hold at least 2 tokens, got {size}")
    if count is not None and count < 1:
        raise ValueError(f"count must be >= 1 or None, got {count}")
    cut = [token_ids[start:start + size] for start in range(0, len(token_ids), size)]
    cut = [w for w in cut if len(w) >= 2]
    if not cut:
        raise ValueError(f"{len(token_ids)} tokens make no window")
    return cut[:count]


def text_windows(llm: LLM, size: int, count: int | None = None) -> list[list[int]]:
    """tests/data/kv_quality.txt, tokenized by the model's tokenizer (no special tokens), in windows."""
    if llm.tokenizer is None:
        raise ValueError("perplexity needs the model's tokenizer")
    return windows(llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False), size, count)


def perplexity(llm: LLM, token_windows: list[list[int]]) -> float:
    """exp of minus the mean logprob of every token after the first of each window, all windows in one call
    (prompt logprobs of the raw logits; max_tokens=0 computes the prompts only)."""
    outs = llm.generate(token_windows, SamplingParams(max_tokens=0, prompt_logprobs=0))
    logprobs = [p.logprob for out in outs for p in (out.prompt_logprobs or [])[1:] if p is not None]
    expected = sum(len(w) - 1 for w in token_windows)
    if len(logprobs) != expected:
        raise RuntimeError(f"{len(logprobs)} prompt logprobs for {expected} scored tokens")
    return math.exp(-sum(logprobs) / len(logprobs))


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def greedy_outputs(llm: LLM, pairs: list[tuple[str, str | None]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each (question, adapter), through the chat template, stopping at the end of the turn."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return [out.token_ids for out in llm.chat([conversation(q) for q, _ in pairs], params, [a for _, a in pairs])]


def forced_top1(llm: LLM, pairs: list[tuple[str, str | None]], reference: list[list[int]]) -> float:
    """Teacher forcing: each reference output appended to its chat prompt, the share of its tokens that this
    engine also ranks first after the same prefix. Per token, so unlike free-running greedy agreement one early
    difference does not carry down the rest of an output."""
    if len(pairs) != len(reference):
        raise ValueError(f"{len(pairs)} requests against {len(reference)} reference outputs")
    prompts = [llm.chat_prompt_ids(conversation(q)) + ref for (q, _), ref in zip(pairs, reference)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0), [a for _, a in pairs])
    ranks = [p.rank for out, ref in zip(outs, reference) if ref
             for p in (out.prompt_logprobs or [])[len(out.prompt_token_ids) - len(ref):] if p is not None]
    return sum(rank == 1 for rank in ranks) / max(len(ranks), 1)


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict[str, float]:
    """How far `outputs` follow `reference`, prompt by prompt: `token_match`, positions equal over the longer
    of the two outputs' positions (a missing token counts as a difference); `prefix_match`, reference tokens
    before the first difference; `identical`, the share of whole outputs equal."""
    if len(reference) != len(outputs):
        raise ValueError(f"{len(reference)} reference outputs against {len(outputs)}")
    equal = positions = prefix = reference_tokens = 0
    for ref, out in zip(reference, outputs):
        equal += sum(a == b for a, b in zip(ref, out))
        positions += max(len(ref), len(out))
        prefix += next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        reference_tokens += len(ref)
    return {"token_match": equal / max(positions, 1), "prefix_match": prefix / max(reference_tokens, 1),
            "identical": sum(ref == out for ref, out in zip(reference, outputs)) / max(len(reference), 1)}


def scale_exponents(llm: LLM) -> tuple[int, int] | None:
    """log2 of the smallest and largest KV scale of an FP8 cache; None for a cache in the model's dtype."""
    if llm.config.torch_kv_cache_dtype is None:
        return None
    exponents = llm.engine.runner.memory.kv_scales.float().log2()
    return int(exponents.min()), int(exponents.max())


def measure(options: dict[str, Any], sizes: Sizes, pairs: list[tuple[str, str | None]],
            reference: list[list[int]] | None = None) -> Measured:
    """One engine of the cache `options`: capacity first (no adapter resident yet), then greedy outputs, auto's
    `reference` outputs under teacher forcing (None: this engine's own, the auto run) and perplexity."""
    gc.collect()                      # the previous engine's pool goes before this one's is allocated
    start = time.perf_counter()
    llm = LLM(pool_gib=POOL_GIB, **options)
    capacity = llm.pool_stats()["kv_token_capacity"]
    outputs = greedy_outputs(llm, pairs, sizes.max_tokens)
    forced = forced_top1(llm, pairs, outputs if reference is None else reference)
    token_windows = text_windows(llm, sizes.window, sizes.windows)
    ppl = perplexity(llm, token_windows)
    return Measured(outputs, ppl, sum(len(w) - 1 for w in token_windows), capacity, forced, scale_exponents(llm),
                    time.perf_counter() - start, llm.engine.model_config.num_layers)


def row(name: str, options: dict[str, Any], m: Measured, auto: Measured) -> dict[str, Any]:
    match = agreement(auto.outputs, m.outputs)
    return {"config": name, "kv_cache_dtype": options.get("kv_cache_dtype", "auto"),
            "scales": options.get("kv_cache_scales", "calibrate") if options else None,
            "skip_layers": options.get("kv_cache_dtype_skip_layers"),
            **match, "forced_top1": m.forced_top1, "ppl": m.ppl, "ppl_delta_pct": 100 * (m.ppl / auto.ppl - 1),
            "ppl_tokens": m.ppl_tokens,
            "kv_token_capacity": m.kv_token_capacity, "capacity_x": m.kv_token_capacity / auto.kv_token_capacity,
            "scale_log2_min": m.scales_log2[0] if m.scales_log2 else None,
            "scale_log2_max": m.scales_log2[1] if m.scales_log2 else None, "seconds": m.seconds}


def by_adapter(auto: Measured, m: Measured, pairs: list[tuple[str, str | None]]) -> dict[str, dict[str, float]]:
    """agreement() restricted to each adapter's prompts (the JSON's breakdown)."""
    result = {}
    for adapter in dict.fromkeys(adapter for _, adapter in pairs):
        picked = [i for i, (_, a) in enumerate(pairs) if a == adapter]
        result[adapter or "base"] = agreement([auto.outputs[i] for i in picked], [m.outputs[i] for i in picked])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="auto and fp8 only, 2 prompts of 8 tokens, one "
                                                             "window of 128 tokens (the smoke test)")
    parser.add_argument("--out", default=None, help="the JSON's path (default: results/cpu/kv_quality.json)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sizes = QUICK if args.quick else FULL
    pairs = requests(sizes)
    auto = measure({}, sizes, pairs)
    configs = configurations(auto.num_layers, args.quick)
    measured = {"auto": auto, **{name: measure(options, sizes, pairs, auto.outputs)
                                 for name, options in configs.items() if name != "auto"}}
    rows = [row(name, configs[name], m, auto) for name, m in measured.items()]
    print_table([{key: r[key] for key in TABLE_KEYS} for r in rows])
    out = Path(args.out) if args.out else default_out("kv_quality", "cpu")
    write_json(out, {"benchmark": "kv_quality", "quick": args.quick, "device": "cpu", "dtype": "float32",
                     "model": "SmolLM2-135M-Instruct", "pool_gib": POOL_GIB, "sizes": asdict(sizes),
                     "requests": len(pairs), "adapters": [a or "base" for a in ADAPTERS], "text": TEXT.name,
                     "rows": rows, "by_adapter": {name: by_adapter(auto, m, pairs) for name, m in measured.items()
                                                  if name != "auto"}})


if __name__ == "__main__":
    main()
