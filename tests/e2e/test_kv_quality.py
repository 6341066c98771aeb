"""The quality an FP8 KV cache keeps on the default model (SmolLM2-135M-Instruct, float32, CPU) against the
float32 cache: the perplexity of tests/data/kv_quality.txt and greedy tokens under teacher forcing, with the
measures of benchmarks/kv_quality.py (which reports them in full). The bounds are measured ones with margin."""
import pytest
from benchmark_modules import load_benchmark

from slora import LLM

KV_QUALITY = load_benchmark("kv_quality.py", "bench_kv_quality")
WINDOW, WINDOWS = 512, 2
# Measured on the first two windows of 512 tokens (2026-12-07): calibrated scales +0.9%, scales 1.0 +0.7%
# (window by window: +1.8% and +0.1%, +1.4% and +0.1%). The bound is over three times that.
MAX_PPL_INCREASE = 0.03
# Two requests, as the benchmark asks them, 32 tokens at most.
PAIRS = [(KV_QUALITY.PROMPTS[0], None), (KV_QUALITY.PROMPTS[3], "demo-pirate")]
MAX_TOKENS = 32
# Of the float32 cache's greedy tokens (50 here), the share the FP8 cache also ranks first after the same prefix:
# measured 0.96 (two tokens), and 0.956 over the first four prompts on each adapter. 0.85 leaves room for 7.
MIN_FORCED_TOP1 = 0.85


@pytest.fixture(scope="module")
def text_windows(smollm2):
    return KV_QUALITY.text_windows(smollm2, WINDOW, WINDOWS)


@pytest.fixture(scope="module")
def auto_ppl(smollm2, text_windows) -> float:
    """The float32 cache's perplexity, computed once for both FP8 engines."""
    return KV_QUALITY.perplexity(smollm2, text_windows)


@pytest.fixture(scope="module")
def fp8():
    return LLM(kv_cache_dtype="fp8")


def test_fp8_cache_perplexity_stays_near_the_float32_caches(fp8, text_windows, auto_ppl):
    assert len(text_windows) == WINDOWS and all(len(w) == WINDOW for w in text_windows)
    increase = KV_QUALITY.perplexity(fp8, text_windows) / auto_ppl - 1
    assert increase != 0, "the FP8 cache should change the logprobs a little: is it quantizing?"
    assert abs(increase) < MAX_PPL_INCREASE, f"perplexity {100 * increase:+.2f}% against the float32 cache"


def test_unit_scales_stay_as_near_on_this_model(text_windows, auto_ppl):
    """Not measurably worse, as one might expect: SmolLM2's |K| and |V| reach at most 28 (its calibrated scales run
    from 2**-10 to 2**-4), inside E4M3's range (448) at scale 1.0, and a float format's relative precision does
    not depend on the scale: only values below 2**-6, subnormal at scale 1.0, lose bits. Measured, scales 1.0
    came out as near or a little nearer (+0.55% against +0.67% over the whole text, nearer in 3 of its 4
    windows); so only the bound is asserted, no order."""
    ones = LLM(kv_cache_dtype="fp8", kv_cache_scales="ones")
    assert ones.engine.runner.memory.kv_scales.eq(1).all()
    increase = KV_QUALITY.perplexity(ones, text_windows) / auto_ppl - 1
    assert abs(increase) < MAX_PPL_INCREASE, f"perplexity {100 * increase:+.2f}% against the float32 cache"


def test_fp8_cache_ranks_the_float32_caches_greedy_tokens_first(smollm2, fp8):
    """Under teacher forcing, not free running: there one near-tie decided the other way changes the rest of
    an output, so the free agreement of two requests says little (0.34 of their tokens measured); the
    benchmark reports it over its whole prompt set."""
    reference = KV_QUALITY.greedy_outputs(smollm2, PAIRS, MAX_TOKENS)
    assert all(reference), "each request should generate tokens"
    forced = KV_QUALITY.forced_top1(fp8, PAIRS, reference)
    assert forced >= MIN_FORCED_TOP1, f"{forced:.3f} of the greedy tokens ranked first under teacher forcing"
