"""PEFT config features that change what an adapter computes: layers_to_transform, regex and
all-linear targets. Each must match transformers + PEFT."""
import pytest
from tiny import oracle_greedy, random_prompts

from slora import LLM, SamplingParams
from slora.models.tiny import build_demo_adapter

FEATURES = {
    "layers": dict(rank=6, targets=["q_proj", "v_proj", "down_proj"], layers_to_transform=[1]),
    "regex": dict(rank=5, targets=r".*\.0\.self_attn\.(q|k)_proj"),
    "all-linear": dict(rank=3, targets="all-linear"),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_matches_peft(feature, tiny_llama, tmp_path):
    spec = dict(FEATURES[feature])
    folder = tmp_path / feature
    build_demo_adapter(tiny_llama.model_dir, folder, spec.pop("rank"), spec.pop("targets"), 12, seed=21, **spec)
    prompts = random_prompts([9, 23], seed=5)
    expected = oracle_greedy(tiny_llama.model_dir, {feature: folder}, prompts, [feature, None], 6)
    llm = LLM(str(tiny_llama.model_dir), num_pages=128)
    llm.load_adapter(feature, str(folder))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                           adapters=[feature, None])
    assert [o.token_ids for o in outputs] == expected
    base = llm.generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert base[0].token_ids != expected[0], "the adapter should change the output"
