"""Step statistics count every step by its kind and the tokens it ran."""
from slora import LLM, SamplingParams
from slora.step_stats import step_kind
from slora.scheduler import ScheduledSeq
from tiny import random_prompts


def test_steps_are_counted_by_kind(tiny_llama):
    llm = LLM(str(tiny_llama.model_dir), num_pages=256, max_num_batched_tokens=32)
    prompts = random_prompts([40, 5], seed=3)            # 45 prompt tokens: more than one 32-token step
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    stats = llm.engine.step_stats
    assert sum(stats.tokens.values()) == 45 + 2 * 5     # every prompt token once, then 5 decode tokens each
    assert stats.steps["prefill"] >= 1 and stats.steps["decode"] >= 1
    assert sum(stats.steps.values()) == llm.engine.scheduler.step_count
    assert stats.slowest_seconds >= max(stats.seconds[k] / stats.steps[k] for k in stats.steps if stats.steps[k])


def test_step_kind_of_a_batch():
    class Seq:   # step_kind looks only at the token counts
        pass
    rows = lambda *counts: [ScheduledSeq(Seq(), n) for n in counts]
    assert step_kind(rows(1, 1, 1)) == "decode"
    assert step_kind(rows(7, 30)) == "prefill"
    assert step_kind(rows(1, 30)) == "mixed"
