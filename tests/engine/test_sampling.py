"""Sampling: seeds, temperature, top-k/top-p, stop strings and stop ids, n."""
import pytest
import torch
from tiny import random_prompts

from slora import LLM, SamplingParams
from slora.models.builtin import TINY_MODEL
from slora.sampling.sampler import SamplingTensors, filter_logits, uniform_noise, unit_interval
from slora.sampling.sampler import sample as sample_tokens


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


def test_a_tiny_top_p_alone_is_greedy(llm):
    # The only truncating row of its batch truncates by top_p alone: the sampler must not skip the filter.
    greedy = sample(llm, "a", temperature=0).token_ids
    assert sample(llm, "a", temperature=1.5, top_p=1e-6, seed=3).token_ids == greedy
    assert sample(llm, "a", temperature=1.5, seed=3).token_ids != greedy       # the seed alone would not do


def test_filter_logits_top_k_and_top_p_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    probs = torch.softmax(logits[0], 0)
    top_p = float(probs[0] + probs[1] / 2)                                  # needs the top two
    kept = filter_logits(logits, torch.ones(2), torch.tensor([2, 0]), torch.tensor([1.0, top_p]))
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()
    assert torch.isfinite(kept[1, 3:]).all() and torch.isinf(kept[1, :3]).all()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(4000, 3)
    params = SamplingTensors(torch.ones(4000), torch.zeros(4000, dtype=torch.long), torch.ones(4000),
                             torch.arange(4000), torch.zeros(4000, dtype=torch.long))
    counts = torch.bincount(sample_tokens(logits, params), minlength=3).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_noise_is_uniform_and_a_function_of_seed_and_step():
    noise = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 20000)
    assert 0 < noise.min() and noise.max() < 1 and abs(noise.mean() - 0.5) < 0.01
    assert torch.equal(noise[0], uniform_noise(torch.tensor([1]), torch.tensor([0]), 20000)[0])
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])


def test_noise_never_reaches_one_so_masked_tokens_are_never_drawn():
    """The extreme bit patterns map inside (0, 1): Gumbel noise stays finite, and a -inf logit (masked by a
    grammar, top-k or top-p) stays -inf after it is added, never NaN (which argmax would pick)."""
    extremes = unit_interval(torch.tensor([-1, 0, 2 ** 62, -(2 ** 63)], dtype=torch.int64))
    assert (extremes > 0).all() and (extremes < 1).all()
    gumbel = -torch.log(-torch.log(extremes))
    assert torch.isfinite(gumbel).all()
    assert torch.isneginf(torch.tensor(float("-inf")) + gumbel).all()


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


@pytest.mark.parametrize("bad", [dict(max_tokens=-1), dict(temperature=-1.0), dict(top_p=0.0), dict(n=0),
                                 dict(top_k=-5), dict(stop=[""]), dict(stop_token_ids=[-1]), dict(logprobs=21),
                                 dict(prompt_logprobs=-1), dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                 dict(repetition_penalty=0.0), dict(min_tokens=17), dict(min_p=1.5),
                                 dict(logit_bias={5: 101.0}), dict(logit_bias={-1: 1.0}), dict(best_of=1, n=2)])
def test_invalid_sampling_params_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


@pytest.mark.parametrize("bad, field", [
    (dict(seed=2 ** 63), "seed"), (dict(seed=-2 ** 63 - 1), "seed"),
    (dict(seed=2 ** 63 - 1, n=2), "seed"),              # sample 1 would use seed + 1, past int64
    (dict(seed=2 ** 63 - 3, n=4), "seed"),
    (dict(top_k=2 ** 63), "top_k"), (dict(top_k=2 ** 31), "top_k"),
    (dict(seed=1.5), "seed"), (dict(seed=True), "seed"), (dict(temperature="hot"), "temperature"),
    (dict(top_p="1"), "top_p"), (dict(max_tokens=2.0), "max_tokens"),
])
def test_sampling_params_outside_their_range_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=f"SamplingParams\\.{field} must be"):
        SamplingParams(**bad)


def test_seeds_at_the_ends_of_int64_sample(llm):
    """The extreme seeds that are allowed run through the sampler (every sample's seed fits in int64), each
    sample with its own seed."""
    prompts = [PROMPT, PROMPT[:6]]
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=2 ** 63 - 2, n=2, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=1.0, seed=-2 ** 63, n=2, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    assert [[len(o.token_ids) for o in out.outputs] for out in outs] == [[4, 4], [4, 4]]
    assert all(o.finish_reason == "length" for out in outs for o in out.outputs)
    last = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=1.0, seed=2 ** 63 - 1, ignore_eos=True))
    assert last[0].token_ids == outs[0].outputs[1].token_ids        # sample 1 of seed 2**63 - 2


def test_a_top_k_at_least_the_vocabulary_is_no_top_k(llm):
    vocab = llm.engine.model_config.vocab_size
    unfiltered = sample(llm, temperature=1.3, seed=21, max_tokens=6).token_ids
    for top_k in (vocab, 2 ** 31 - 1):
        assert sample(llm, temperature=1.3, seed=21, max_tokens=6, top_k=top_k).token_ids == unfiltered
    # A top_k below the vocabulary still filters: the same seed then draws otherwise.
    assert sample(llm, temperature=1.3, seed=21, max_tokens=6, top_k=2).token_ids != unfiltered


def test_a_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    before = llm.pool_stats()
    with pytest.raises(ValueError, match="adapter 'missing' does not exist"):
        llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=4), adapters=["a", "missing"])
    assert not llm.engine.has_unfinished()
    assert llm.pool_stats()["kv_pages"] == before["kv_pages"] == 0
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0))[0].finish_reason == "length"


def test_tiny_model_with_a_small_max_lora_rank_skips_larger_demo_adapters():
    llm = LLM(TINY_MODEL, max_lora_rank=8)
    names = {entry.name for entry in llm.engine.adapters.visible_to(None)}
    assert names == {"demo-r4-attn", "demo-r8-mlp"}


def test_a_max_lora_rank_whose_adapters_exceed_the_kernels_int32_indexing_is_rejected():
    """The LoRA kernels index an adapter's pool elements in int32: an engine whose largest adapter would
    span 2**31 of them is refused at construction, naming the setting."""
    with pytest.raises(ValueError, match="max_lora_rank=.*2\\*\\*31"):
        LLM(TINY_MODEL, max_lora_rank=2 ** 24)


def test_rows_without_top_k_or_top_p_sample_as_if_unfiltered():
    # A top_p = 1 row among truncated rows must draw what it draws when no row truncates (the sampler then
    # skips the sort); a vocabulary whose float32 running sum reaches 1 early must not drop its tail.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50_000, generator=gen) * 3
    params = SamplingTensors(torch.tensor([0.7, 1.0, 1.3, 0.9]), torch.tensor([0, 5, 0, 0]),
                             torch.tensor([1.0, 1.0, 0.5, 1.0]), torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 7, 9]))
    mixed = sample_tokens(logits, params, truncate=True)
    plain = sample_tokens(logits, params, truncate=False)
    assert mixed[0] == plain[0] and mixed[3] == plain[3]
    filtered = filter_logits(logits, params.temperatures, params.top_ks, params.top_ps)
    assert torch.isfinite(filtered[0]).all() and torch.isfinite(filtered[3]).all()
    assert torch.isfinite(filtered[1]).sum() == 5


def test_unstreamed_requests_are_returned_once_when_they_end(llm):
    engine = llm.engine
    prompts = random_prompts([6, 9], seed=8)
    for request_id, prompt, max_tokens in (("short", prompts[0], 2), ("long", prompts[1], 5)):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           stream=False)
    seen, steps = [], 0
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        assert all(o.finished for o in outputs)
        seen += [(o.request_id, len(o.token_ids)) for o in outputs]
    assert sorted(seen) == [("long", 5), ("short", 2)] and steps >= 5


@pytest.mark.parametrize("stop_string", [False, True])
def test_unstreamed_requests_decode_their_text_once_at_the_end(llm, stop_string):
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    streamed_text = sample(llm, temperature=0, max_tokens=12).text
    if stop_string:        # a stop string needs the text as it grows: decoded token by token after all
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[streamed_text[5:7]])
    engine.add_request("quiet", PROMPT, params, stream=False)
    texts = []
    while engine.has_unfinished():
        outputs = engine.step()          # an unstreamed request comes back only when it ends: read its state
        texts += [(o.finished, o.text) for o in outputs] or [(False, engine.requests["quiet"].texts[0])]
    running = [text for finished, text in texts if not finished]
    assert running and all(text == "" for text in running) != stop_string
    expected = streamed_text[:streamed_text.find(streamed_text[5:7])] if stop_string else streamed_text
    assert texts[-1] == (True, expected)
