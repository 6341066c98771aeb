"""Incremental detokenization gives the text a full decode gives, token after token."""
import random

import pytest
from transformers import AutoTokenizer

from slora.models.tiny import ensure_tiny_model
from slora.sampling.detokenizer import IncrementalDetokenizer, fast_decoder


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_tiny_model().model_dir))


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_is_a_prefix_of_the_full_decode_and_ends_equal(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(200)]     # random bytes: split UTF-8 characters
    detokenizer = IncrementalDetokenizer(tokenizer)
    for count, token in enumerate(ids, start=1):
        text = detokenizer.add(token)
        full = tokenizer.decode(ids[:count], skip_special_tokens=True)
        assert full.startswith(text)
        assert "\ufffd" not in text[-1:] or full.endswith(text)
    assert detokenizer.final_text() == tokenizer.decode(ids, skip_special_tokens=True)


def test_real_text_streams_exactly(tokenizer):
    ids = tokenizer.encode("Hello, how are you today? Ça va très bien — merci! 😀 The quick brown fox.")
    detokenizer = IncrementalDetokenizer(tokenizer)
    for token in ids:
        detokenizer.add(token)
    assert detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("clean_up", [False, True])
def test_fast_decoder_gives_what_transformers_decode_gives(clean_up, monkeypatch):
    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_model().model_dir), clean_up_tokenization_spaces=clean_up)
    decode = fast_decoder(tok)
    rng = random.Random(7)
    texts = ["Hello , world ! it 's fine .", "a  b\n\tc", "x"]
    id_lists = [tok.encode(t) for t in texts] + [[rng.randrange(len(tok)) for _ in range(40)] for _ in range(5)]
    expected = [tok.decode(ids, skip_special_tokens=True) for ids in id_lists]
    calls = []
    original = tok.decode
    monkeypatch.setattr(tok, "decode", lambda *a, **k: calls.append(1) or original(*a, **k))
    for ids, text in zip(id_lists, expected):
        assert decode(ids) == text
    # Without clean-up the Rust tokenizer decodes alone; with it, transformers' decode must (its clean-up
    # is not the backend's).
    assert (len(calls) == len(id_lists)) if clean_up else not calls
