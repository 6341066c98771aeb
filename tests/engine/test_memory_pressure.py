"""Outputs do not change when the pool forces preemption or adapter eviction; no page leaks."""
import pytest
from tiny import oracle_greedy, random_prompts

from slora import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def load_all(llm: LLM, adapters: dict) -> None:
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))


def test_preemption_keeps_outputs(tiny_llama):
    adapters = {n: tiny_llama.adapters[n] for n in ("attn-r4", "mlp-r8")}
    prompts = random_prompts([20, 33, 41, 27, 50, 18, 36, 44], seed=1)
    names = ["attn-r4", "mlp-r8", None, "attn-r4", "mlp-r8", None, "mlp-r8", "attn-r4"]
    expected = oracle_greedy(tiny_llama.model_dir, adapters, prompts, names, PARAMS.max_tokens)
    llm = LLM(str(tiny_llama.model_dir), page_size=8, num_pages=40, watermark=0.0)
    load_all(llm, adapters)
    outputs = llm.generate(prompts, PARAMS, adapters=names)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected
    llm.engine.check()
    assert llm.pool_stats()["kv_pages"] == 0


def test_adapters_evicted_and_reloaded_between_requests(tiny_llama):
    adapters = tiny_llama.adapters
    prompts = random_prompts([12, 30, 25, 9, 40, 16], seed=2)
    names = ["all-r16", "rs-pattern", "mlp-r8", "all-r16", "attn-r4", "rs-pattern"]
    expected = oracle_greedy(tiny_llama.model_dir, adapters, prompts, names, PARAMS.max_tokens)
    # one sequence at a time, and room for only about one large adapter beside its KV
    llm = LLM(str(tiny_llama.model_dir), page_size=8, num_pages=48, max_num_seqs=1, watermark=0.0)
    load_all(llm, adapters)
    outputs = llm.generate(prompts, PARAMS, adapters=names)
    residency = llm.engine.adapters
    assert residency.num_evictions > 0 and residency.num_loads > len(set(names))
    assert [o.token_ids for o in outputs] == expected
    llm.engine.check()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_page_accounting(tiny_llama, prefix_caching):
    llm = LLM(str(tiny_llama.model_dir), page_size=16, num_pages=200, enable_prefix_caching=prefix_caching)
    load_all(llm, tiny_llama.adapters)
    names = list(tiny_llama.adapters) + [None]
    llm.generate(random_prompts([5, 50, 17, 33, 8], seed=3), PARAMS, adapters=names)
    stats = llm.pool_stats()
    assert stats["kv_pages"] == 0 and stats["adapter_pages"] > 0
    assert (stats["cached_pages"] > 0) == prefix_caching      # full pages stay as cached KV
    llm.engine.check()
    for name in tiny_llama.adapters:
        llm.unload_adapter(name)
    stats = llm.pool_stats()
    assert stats["adapter_pages"] == stats["kv_pages"] == 0
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"] == 200
    llm.engine.check()
