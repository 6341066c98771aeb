"""Step statistics count every step by its kind and the tokens it ran."""
from tiny import random_prompts

from slora import LLM, SamplingParams
from slora.core.scheduler import ScheduledSeq
from slora.core.step_stats import step_kind


def test_steps_are_counted_by_kind(tiny_llama):
    llm = LLM(str(tiny_llama.model_dir), num_pages=256, max_num_batched_tokens=32)
    prompts = random_prompts([40, 5], seed=3)            # 45 prompt tokens: more than one 32-token step
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    stats = llm.engine.step_stats
    assert sum(stats.tokens.values()) == 45 + 2 * 5     # every prompt token once, then 5 decode tokens each
    assert stats.steps["prefill"] >= 1 and stats.steps["decode"] >= 1
    # Overlapped, the last schedule runs no forward: its step only takes the tokens of the step before.
    assert sum(stats.steps.values()) == llm.engine.scheduler.step_count - llm.engine.config.async_scheduling
    assert stats.slowest_seconds >= max(stats.seconds[k] / stats.steps[k] for k in stats.steps if stats.steps[k])
    assert stats.slowest_seconds <= sum(stats.seconds.values())


def test_decode_bytes_count_weights_live_kv_and_each_adapter_once(tiny_llama):
    llm = LLM(str(tiny_llama.model_dir), num_pages=256)
    llm.load_adapter("r16", str(tiny_llama.adapters["all-r16"]))
    engine = llm.engine
    prompts = random_prompts([7, 9], seed=4)
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), adapters=["r16", "r16"])
    cfg = engine.model_config
    embed = engine.model.model.embed_tokens.weight
    assert engine.model.lm_head.weight is not embed                             # untied: only rows are read
    weights = sum(p.numel() * 4 for p in engine.model.parameters()) - embed.numel() * 4   # float32
    row = embed.shape[1] * 4
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    version = engine.adapters.lookup("r16", None).version
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    in_plus_out = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)   # q k v o gate up down
    adapter = in_plus_out * 16 * cfg.num_layers * 4                              # rank 16 on all seven, every layer
    assert engine.adapters.weight_bytes(version) == adapter
    # Two decode steps; before them the sequences hold 7+1, 9+1 tokens, then one more each.
    live = (8 + 10) + (9 + 11)
    assert engine.step_stats.steps["decode"] == 2
    assert engine.step_stats.decode_bytes == 2 * (weights + 2 * row) + live * kv_per_token + 2 * adapter
    assert engine.step_stats.decode_bandwidth > 0


def test_step_kind_of_a_batch():
    class Seq:   # step_kind looks only at the token counts
        pass
    rows = lambda *counts: [ScheduledSeq(Seq(), n) for n in counts]
    assert step_kind(rows(1, 1, 1)) == "decode"
    assert step_kind(rows(7, 30)) == "prefill"
    assert step_kind(rows(1, 30)) == "mixed"

