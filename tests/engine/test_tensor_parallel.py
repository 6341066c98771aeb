"""Tensor parallelism on the CPU: two ranks over gloo give the greedy tokens of one rank, token for token in float32,
with adapters in both schemes, under preemption (recompute and swap), adapter eviction, forks and beam search; a
rank that ends stops the engine with an error naming it, and nothing hangs."""
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
from tiny import make_adapters, make_model, random_prompts

from slora import LLM, SamplingParams
from slora.execution.tensor_parallel import TensorParallelError
from slora.models.tiny import build_demo_adapter

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny llama (4 heads, 2 KV heads: split in two) and its test adapters, one of odd rank 3 (its
    fully sharded part is padded to an even rank)."""
    root = tmp_path_factory.mktemp("tp")
    model_dir = make_model(root, "llama", seed=5)
    adapters = make_adapters(model_dir, root, ["attn-r4", "mlp-r8", "all-r16", "rs-pattern"])
    adapters["odd-r3"] = root / "odd-r3"
    build_demo_adapter(model_dir, adapters["odd-r3"], 3, ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                       6, 21)
    return model_dir, adapters


def generate(model_dir, adapters, prompts, names, params=GREEDY, **options) -> list[list[list[int]]]:
    """Every sample's tokens, from an engine of `options` (closed after)."""
    with LLM(str(model_dir), **options) as llm:
        for name, path in adapters.items():
            llm.load_adapter(name, str(path))
        outputs = llm.generate(prompts, params, adapters=names)
        llm.engine.check()
        stats = llm.pool_stats()
        assert stats["kv_pages"] == 0, stats
    return [[sample.token_ids for sample in out.outputs] for out in outputs]


def mixed_batch(count: int, seed: int) -> tuple[list[list[int]], list[str | None]]:
    names = [None, "attn-r4", "mlp-r8", "all-r16", "rs-pattern", "odd-r3"]
    lengths = [9 + (7 * i) % 40 for i in range(count)]
    return random_prompts(lengths, seed=seed), [names[i % len(names)] for i in range(count)]


@pytest.fixture(scope="module")
def one_rank(setup) -> tuple[list, list, list]:
    """A mixed batch of every adapter and the base model, and its tokens from one rank."""
    model_dir, adapters = setup
    prompts, names = mixed_batch(12, seed=1)
    return prompts, names, generate(model_dir, adapters, prompts, names)


@pytest.mark.parametrize("fully_sharded, async_scheduling", [(False, True), (True, True), (True, False)],
                         ids=["replicated-A", "fully-sharded", "fully-sharded-sync"])
def test_two_ranks_match_one_with_adapters(setup, one_rank, fully_sharded, async_scheduling):
    model_dir, adapters = setup
    prompts, names, expected = one_rank
    two = generate(model_dir, adapters, prompts, names, async_scheduling=async_scheduling, tensor_parallel_size=2,
                   fully_sharded_loras=fully_sharded)
    assert two == expected


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_two_ranks_under_preemption_and_adapter_eviction(setup, preemption_mode):
    """A pool too small for the batch: sequences are preempted (their KV recomputed or swapped on every rank)
    and adapters evicted and loaded again, into the same pages of every rank."""
    model_dir, adapters = setup
    prompts, names = mixed_batch(10, seed=2)
    tight = dict(page_size=8, num_pages=64, watermark=0.0, preemption_mode=preemption_mode)
    one = generate(model_dir, adapters, prompts, names, num_pages=400)
    with LLM(str(model_dir), tensor_parallel_size=2, fully_sharded_loras=True, **tight) as llm:
        for name, path in adapters.items():
            llm.load_adapter(name, str(path))
        outputs = llm.generate(prompts, GREEDY, adapters=names)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.adapters.num_evictions > 0
        llm.engine.check()
    assert [[s.token_ids for s in out.outputs] for out in outputs] == one


def test_two_ranks_fork_samples_and_search_beams(setup):
    """n > 1 forks share pages and copy the partial last one on write (a copy on every rank); beam search
    forks and ends beams as it goes."""
    model_dir, adapters = setup
    prompts = random_prompts([21, 30], seed=3)
    forks = SamplingParams(max_tokens=8, temperature=0.8, seed=4, n=3, ignore_eos=True)
    beams = SamplingParams(max_tokens=8, use_beam_search=True, beam_width=4, n=2, stop_token_ids=[7])
    for params in (forks, beams):
        one = generate(model_dir, adapters, prompts, ["all-r16", None], params)
        two = generate(model_dir, adapters, prompts, ["all-r16", None], params, tensor_parallel_size=2)
        assert two == one


def test_a_rank_that_ends_stops_the_engine_with_its_name(setup):
    model_dir, _ = setup
    llm = LLM(str(model_dir), tensor_parallel_size=2)
    try:
        llm.generate(random_prompts([12], seed=4), GREEDY)
        rank = next(p for p in multiprocessing.active_children() if p.name == "slora-tp-rank-1")
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(30)
        began = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 ended \(exit code -9\)"):
            llm.generate(random_prompts([12], seed=5), GREEDY)
        assert time.monotonic() - began < 10
    finally:
        llm.close()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("slora-tp-rank")]


def test_one_tensor_parallel_engine_at_a_time_per_process(setup):
    model_dir, _ = setup
    with LLM(str(model_dir), tensor_parallel_size=2):
        with pytest.raises(ValueError, match="already runs a tensor-parallel engine"):
            LLM(str(model_dir), tensor_parallel_size=2)
    with LLM(str(model_dir), tensor_parallel_size=2) as again:        # once closed, another may start
        assert again.generate(random_prompts([6], seed=7), GREEDY)[0].outputs[0].token_ids



@pytest.mark.parametrize("scales", ["calibrate", "file"])
def test_two_ranks_with_an_fp8_cache_match_one(setup, tmp_path, scales):
    """Each rank finds its own KV heads' scales (calibrating at once, or cutting a file's per-head list)."""
    model_dir, adapters = setup
    if scales == "file":                    # a scale per layer and KV head, each head's its own
        per_layer = [[0.25, 0.5] for _ in range(2)]
        scales = str(tmp_path / "scales.json")
        Path(scales).write_text(json.dumps({"k_scale": per_layer, "v_scale": [[0.125, 1.0]] * 2}))
    prompts, names = mixed_batch(6, seed=6)
    fp8 = dict(kv_cache_dtype="fp8", kv_cache_scales=scales)
    one = generate(model_dir, adapters, prompts, names, **fp8)
    assert generate(model_dir, adapters, prompts, names, tensor_parallel_size=2, **fp8) == one
