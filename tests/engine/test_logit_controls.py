"""Each sampling control shows its effect, and is a no-op at its neutral value: logit_bias, min_tokens,
presence / frequency / repetition penalties, min_p. On the sampler's batched path (several rows with
different controls in one call), and through the engine for bias, min_tokens and the vocabulary check."""
import pytest
import torch
from tiny import make_model

from slora import LLM, SamplingParams
from slora.core.sequence import Sequence
from slora.sampling.logit_controls import apply_controls
from slora.sampling.sampler import Sampler

EOS = 2
VOCAB = 12


def seq(prompt=(5, 6), output=(), **params) -> Sequence:
    s = Sequence(1, "r", list(prompt), SamplingParams(max_tokens=16, **{"temperature": 0.0, **params}))
    s.output_token_ids = list(output)
    return s


def logits_of(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def base_row() -> list[float]:
    return [float(v) for v in range(VOCAB)]          # token 11 is the best


def test_neutral_controls_leave_the_logits_untouched():
    logits = torch.randn(3, VOCAB)
    seqs = [seq(output=(3, 3, 4)), seq(output=(1,), presence_penalty=0.0, frequency_penalty=0.0,
                                       repetition_penalty=1.0, min_tokens=0, logit_bias={}), seq()]
    assert torch.equal(apply_controls(logits.clone(), seqs, {EOS}), logits)
    assert Sampler({EOS})(logits, [s for s in seqs]).token_ids == logits.argmax(-1).tolist()


def test_logit_bias_moves_only_its_row_and_tokens():
    logits = logits_of(base_row(), base_row())
    out = apply_controls(logits.clone(), [seq(logit_bias={0: 100.0, 3: -1.5}), seq()], {EOS})
    assert out[0, 0] == 100.0 and out[0, 3] == 1.5 and torch.equal(out[1], logits[1])
    assert Sampler()(logits, [seq(logit_bias={0: 100.0}), seq()]).token_ids == [0, 11]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    row = base_row()
    row[EOS], row[7] = 50.0, 40.0                      # EOS best, then stop token 7
    logits = logits_of(row, row, row, row)
    seqs = [seq(output=(1,), min_tokens=3, stop_token_ids=[7]), seq(output=(1, 1, 1), min_tokens=3),
            seq(min_tokens=3, ignore_eos=True), seq()]
    out = apply_controls(logits.clone(), seqs, {EOS})
    assert out[0, EOS] == out[0, 7] == float("-inf")               # short of min_tokens: cannot end
    assert torch.equal(out[1], logits[1])                           # reached: untouched
    assert out[2, EOS] == 50.0                                      # ignore_eos: EOS is no ending token
    held = [seq(output=(1,), min_tokens=3, stop_token_ids=[7]), seq(output=(1,), stop_token_ids=[7])]
    assert Sampler({EOS})(logits[:2], held).token_ids == [11, EOS]


def test_min_tokens_leaves_the_end_to_a_row_with_nothing_else():
    """A grammar that allows only its end (everything else -inf) still ends under min_tokens; a row with
    another token left loses its EOS."""
    only_end = torch.full((VOCAB,), float("-inf"))
    only_end[EOS] = 1.0
    other_left = only_end.clone()
    other_left[5] = 0.0
    out = apply_controls(torch.stack([only_end, other_left]), [seq(min_tokens=3), seq(min_tokens=3)], {EOS})
    assert out[0, EOS] == 1.0 and out[1, EOS] == float("-inf") and out[1, 5] == 0.0


def test_presence_and_frequency_penalties_count_the_output():
    logits = logits_of(base_row(), base_row())
    seqs = [seq(output=(4, 4, 4, 9), presence_penalty=1.0), seq(output=(4, 4, 4, 9), frequency_penalty=0.5)]
    out = apply_controls(logits.clone(), seqs, {EOS})
    assert out[0, 4] == 4 - 1.0 and out[0, 9] == 9 - 1.0 and out[0, 5] == 5       # once per token seen
    assert out[1, 4] == 4 - 1.5 and out[1, 9] == 9 - 0.5 and out[1, 5] == 5       # once per occurrence
    assert out[0, 6] == 6 and out[1, 6] == 6                   # prompt tokens (5, 6) are not penalized


def test_negative_presence_penalty_rewards_repeats():
    logits = logits_of(base_row())
    assert apply_controls(logits.clone(), [seq(output=(4,), presence_penalty=-2.0)], {EOS})[0, 4] == 6


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    row = base_row()
    row[5], row[8] = -2.0, 4.0                             # prompt token 5 negative, output token 8 positive
    out = apply_controls(logits_of(row), [seq(prompt=(5,), output=(8,), repetition_penalty=2.0)], {EOS})
    assert out[0, 5] == -4.0 and out[0, 8] == 2.0 and out[0, 9] == 9.0


def test_min_p_drops_tokens_below_its_floor():
    row = [0.0] * VOCAB
    row[3], row[4] = 5.0, 4.0                               # p(4) / p(3) = e^-1 = 0.37
    logits = logits_of(*[row] * 300)
    kept = Sampler()(logits, [seq(temperature=1.0, seed=i, min_p=0.3) for i in range(300)]).token_ids
    assert set(kept) == {3, 4}
    strict = Sampler()(logits, [seq(temperature=1.0, seed=i, min_p=0.5) for i in range(300)]).token_ids
    assert set(strict) == {3}
    free = Sampler()(logits, [seq(temperature=1.0, seed=i) for i in range(300)]).token_ids
    assert len(set(free)) > 2                               # min_p = 0: every token can be drawn


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_model(tmp_path_factory.mktemp("controls"))))


def test_engine_applies_logit_bias_and_min_tokens(llm):
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    target = next(t for t in range(3, 50) if t not in free.token_ids)
    biased = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, logit_bias={target: 100.0},
                                                      ignore_eos=True))[0]
    assert biased.token_ids == [target] * 4
    first = free.token_ids[0]
    ends = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[first]))[0]
    assert ends.token_ids == [first] and ends.finish_reason == "stop"
    held = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[first],
                                                    min_tokens=2))[0]
    assert held.token_ids[0] != first and len(held.token_ids) >= 2


def test_engine_refuses_token_ids_outside_the_vocabulary(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias holds token ids outside the vocabulary"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    assert llm.pool_stats()["kv_pages"] == 0
