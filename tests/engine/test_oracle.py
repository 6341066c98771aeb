"""Greedy output of the engine equals transformers + PEFT token for token (float32, CPU)."""
import pytest
from tiny import TEST_ADAPTERS, force_lora_deltas, make_adapters, make_model, oracle_greedy, random_prompts

from slora import LLM, SamplingParams

LENGTHS = [1, 7, 16, 17, 40, 64, 130, 200]
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_model(root, request.param)
    adapters = make_adapters(model_dir, root)
    prompts = random_prompts(LENGTHS)
    # every adapter, and base-only rows, mixed in one batch
    names = [None, *TEST_ADAPTERS, None, "all-r16", "attn-r4"][:len(prompts)]
    expected = oracle_greedy(model_dir, adapters, prompts, names, NEW_TOKENS)
    base_only = oracle_greedy(model_dir, {}, prompts, [None] * len(prompts), NEW_TOKENS)
    changed = [e != b for e, b, n in zip(expected, base_only, names) if n is not None]
    assert sum(changed) >= len(changed) - 1, "the test adapters should change most outputs"
    return model_dir, adapters, prompts, names, expected


@pytest.mark.parametrize("page_size", [8, 16])
def test_mixed_adapter_batch_matches_peft(family, page_size):
    model_dir, adapters, prompts, names, expected = family
    llm = LLM(str(model_dir), page_size=page_size, max_num_batched_tokens=256)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, adapters=names)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert llm.pool_stats()["kv_pages"] == 0
    llm.engine.check()


def test_lora_as_deltas_added_by_the_next_op_matches_peft(family, monkeypatch):
    """The decode graphs' way of applying LoRA (LoraStep.deltas: each group's delta computed apart, then
    added by the rotary, SiLU and norm ops), forced on every step of the CPU engine: still PEFT's tokens."""
    model_dir, adapters, prompts, names, expected = family
    layers = force_lora_deltas(monkeypatch)
    llm = LLM(str(model_dir), max_num_batched_tokens=256)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                           adapters=names)
    assert [o.token_ids for o in outputs] == expected
    assert layers, "no step computed a LoRA delta"
