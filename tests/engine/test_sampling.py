"""Sampling: seeds, temperature, top-k/top-p, stop strings and stop ids, n."""
import pytest
import torch

from slora import LLM, SamplingParams
from slora.sampler import filter_logits
from tiny import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(str(tiny_llama.model_dir), num_pages=256)
    llm.load_adapter("a", str(tiny_llama.adapters["all-r16"]))
    return llm


PROMPT = random_prompts([12], seed=7)[0]


def sample(llm, adapter=None, **params):
    return llm.generate([PROMPT], SamplingParams(**{"max_tokens": 16, "ignore_eos": True, **params}),
                        adapters=[adapter])[0]


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(llm):
    first = sample(llm, "a", temperature=1.0, seed=123)
    again = sample(llm, "a", temperature=1.0, seed=123)
    other = sample(llm, "a", temperature=1.0, seed=124)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


def test_seeded_sample_unchanged_when_batched_with_others(llm):
    alone = sample(llm, temperature=0.8, seed=5).token_ids
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=1.3, seed=9, ignore_eos=True)]
    batched = llm.generate([PROMPT, PROMPT[:5]], params, adapters=[None, "a"])
    assert batched[0].token_ids == alone


def test_n_samples_each_equal_a_run_with_that_seed(llm):
    together = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=40, n=3,
                                                     ignore_eos=True))[0]
    assert len(together.outputs) == 3
    for i, out in enumerate(together.outputs):
        assert out.token_ids == sample(llm, temperature=1.0, seed=40 + i, max_tokens=8).token_ids


def test_top_k_one_is_greedy(llm):
    assert sample(llm, "a", temperature=1.5, top_k=1, seed=3).token_ids == sample(llm, "a", temperature=0).token_ids


def test_filter_logits_top_k_and_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, 1.0, 2, 1.0)[2:]).all()
    probs = torch.softmax(logits, 0)
    kept = filter_logits(logits, 1.0, 0, float(probs[0] + probs[1] / 2))   # needs the top two
    assert torch.isfinite(kept[:2]).all() and torch.isinf(kept[2:]).all()


def test_stop_token_ids_end_with_stop(llm):
    greedy = sample(llm, temperature=0).token_ids
    out = sample(llm, temperature=0, stop_token_ids=[greedy[3]])
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy[:greedy.index(greedy[3]) + 1]


def test_stop_string_ends_generation_and_is_cut_from_text(llm):
    greedy = sample(llm, temperature=0, max_tokens=20)
    text = greedy.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), "need a visible stop string"
    out = sample(llm, temperature=0, max_tokens=20, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == text[:text.find(stop)]
    assert len(out.token_ids) < len(greedy.token_ids)


def test_eos_stops_unless_ignored(llm, tiny_llama):
    eos = llm.tokenizer.eos_token_id
    greedy = sample(llm, temperature=0).token_ids
    llm.engine.eos_token_ids = frozenset({greedy[2]})       # pretend that token is EOS
    try:
        stopped = sample(llm, temperature=0, ignore_eos=False)
        ignored = sample(llm, temperature=0, ignore_eos=True)
    finally:
        llm.engine.eos_token_ids = frozenset({eos})
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 3
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 16


def test_max_tokens_gives_length(llm):
    out = sample(llm, temperature=0, max_tokens=5)
    assert out.finish_reason == "length" and len(out.token_ids) == 5


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(n=0),
                                 dict(top_k=-5), dict(stop=[""]), dict(stop_token_ids=[-1])])
def test_invalid_sampling_params_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
