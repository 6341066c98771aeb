"""benchmarks/workloads.py: the generated traces hit their target statistics, are seeded, and are clipped."""
import math

import numpy as np
import pytest
from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def wl():
    return load_benchmark("workloads.py", "bench_workloads")


@pytest.fixture(scope="module")
def long_tail(wl):
    return wl.long_tail_trace(20_000)


def test_log_normal_parameters_reproduce_the_targets(wl):
    assert wl.PROMPT_DIST.median == pytest.approx(584)
    assert wl.PROMPT_DIST.p95 == pytest.approx(2155)
    assert wl.OUTPUT_DIST.mean == pytest.approx(374)
    assert wl.OUTPUT_DIST.p95 == pytest.approx(1118)
    assert wl.PROMPT_DIST.sigma == pytest.approx(0.7938, abs=1e-3)
    assert wl.OUTPUT_DIST.sigma == pytest.approx(0.9269, abs=1e-3)      # the smaller root
    with pytest.raises(ValueError):
        wl.LogNormal.from_mean_p95(100, 10_000)                         # p95 too far above the mean


def test_long_tail_statistics_near_targets(long_tail):
    prompts = np.array([r.prompt_len for r in long_tail])
    outputs = np.array([r.output_len for r in long_tail])
    assert np.median(prompts) == pytest.approx(584, rel=0.05)
    assert np.percentile(prompts, 95) == pytest.approx(2155, rel=0.07)
    assert outputs.mean() == pytest.approx(374, rel=0.05)
    assert np.percentile(outputs, 95) == pytest.approx(1118, rel=0.07)
    assert all(r.arrival == 0.0 and r.adapter is None and r.rank == 0 for r in long_tail)


def test_long_tail_is_clipped_to_the_context(wl, long_tail):
    totals = np.array([r.prompt_len + r.output_len for r in long_tail])
    assert totals.max() == 4096                        # the tail reaches the limit and stops there
    assert 0 < (totals == 4096).mean() < 0.03          # clipping touches few requests
    assert min(min(r.prompt_len, r.output_len) for r in long_tail) >= 1
    short = wl.long_tail_trace(2000, max_total=1024)
    assert max(r.prompt_len + r.output_len for r in short) <= 1024


def test_clip_lengths_keeps_the_output_and_truncates_the_prompt(wl):
    assert wl.clip_lengths(100, 200, 4096) == (100, 200)
    assert wl.clip_lengths(4000, 500, 4096) == (3596, 500)
    assert wl.clip_lengths(10, 9000, 4096) == (1, 4095)


def test_traces_are_seeded(wl):
    assert wl.long_tail_trace(500) == wl.long_tail_trace(500)
    assert wl.long_tail_trace(500, seed=1) != wl.long_tail_trace(500)
    args = dict(num_requests=500, num_adapters=50, rate=4.0, cv=2.0, alpha=0.5, rank_mix=True)
    assert wl.slora_trace(**args) == wl.slora_trace(**args)
    assert wl.slora_trace(**args, seed=7) != wl.slora_trace(**args)


def test_slora_trace_follows_s_lora_draw_order(wl):
    n, count, alpha = 100, 1000, 0.3
    trace = wl.slora_trace(count, n, rate=2.0, cv=1.0, alpha=alpha)
    rng = np.random.RandomState(42)                    # S-LoRA: np.random.seed(42), then in this order
    adapters = (rng.power(alpha, count) * n).astype(int)
    inputs = rng.randint(8, 513, count)
    assert [r.adapter for r in trace] == adapters.tolist()
    assert [r.prompt_len for r in trace] == inputs.tolist()


def test_slora_trace_statistics(wl):
    n, rate, cv = 200, 5.0, 2.0
    trace = wl.slora_trace(40_000, n, rate, cv=cv, alpha=1.0)
    lengths = np.array([(r.prompt_len, r.output_len) for r in trace])
    assert lengths.min() == 8 and lengths.max() == 512     # both ends of [8, 512] are drawn
    assert lengths.mean() == pytest.approx(260, rel=0.02)
    gaps = np.diff([0.0] + [r.arrival for r in trace])
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)
    adapters = np.array([r.adapter for r in trace])
    assert adapters.min() == 0 and adapters.max() == n - 1
    assert adapters.mean() == pytest.approx((n - 1) / 2, rel=0.03)  # alpha = 1: uniform popularity
    skewed = np.array([r.adapter for r in wl.slora_trace(40_000, n, rate, alpha=0.1)])
    assert skewed.mean() == pytest.approx(n * 0.1 / 1.1, rel=0.1)   # E[power(a)] = a / (a + 1)


def test_adapter_ranks(wl):
    assert {r.rank for r in wl.slora_trace(300, 20, 2.0)} == {8}
    mixed = wl.slora_trace(3000, 100, 2.0, rank_mix=True)
    assert {r.rank for r in mixed} == set(wl.RANKS)
    rank_of = {}
    for r in mixed:
        assert rank_of.setdefault(r.adapter, r.rank) == r.rank          # one rank per adapter
    assert all(math.log2(r) == int(math.log2(r)) for r in rank_of.values())
