"""Structured output (slora.sampling.grammar on xgrammar) with the default model's tokenizer: for each kind, the mask
at the start, a valid output walked to its end, a refused token, random sampling under the mask; invalid
specs, the compile cache, and the bitmask applied to a step's logits."""
import json
import re
import threading
from typing import NamedTuple

import pytest
import torch
from transformers import AutoTokenizer

from slora.models.builtin import TINY_MODEL, resolve_model, smollm2_folder
from slora.sampling.grammar import (
    MAX_ERROR_CHARS,
    GrammarCompiler,
    GrammarState,
    GrammarViolation,
    allocate_bitmask,
    apply_bitmask,
)
from slora.sampling.structured_output import StructuredOutput

VOCAB = 49152                  # SmolLM2's vocabulary, as wide as its logits
SCHEMA = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
EXPRESSION = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'
CHOICES = ("yes", "no", 'say "hi"\n')


class Case(NamedTuple):
    spec: StructuredOutput
    valid: str          # an output that the spec accepts and that cannot go on
    first: str          # a token that begins a valid output
    wrong: str          # a token that cannot begin one


CASES = {
    "json_schema": Case(StructuredOutput("json_schema", json.dumps(SCHEMA)), '{"name": "Ada", "age": 36}', "{", "["),
    "json_object": Case(StructuredOutput("json_object"), '{"a": [1, {"b": null}], "c": "d"}', "{", "["),
    "regex": Case(StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"), "123-abcd", "1", "a"),
    "choice": Case(StructuredOutput("choice", CHOICES), CHOICES[2], "say", "maybe"),
    "grammar": Case(StructuredOutput("grammar", EXPRESSION), "(12+345)", "(", ")"),
}


def valid_json(text: str) -> bool:
    """Whether `text` is an instance of SCHEMA (by hand; compiled in strict mode: no other properties)."""
    value = json.loads(text)
    return (isinstance(value, dict) and {"name", "age"} <= value.keys() <= {"name", "age", "tags"}
            and isinstance(value["name"], str) and type(value["age"]) is int and value["age"] >= 0
            and all(isinstance(tag, str) for tag in value.get("tags", [])))


VALID = {
    "json_schema": valid_json,
    "json_object": lambda text: isinstance(json.loads(text), dict),
    "regex": lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) is not None,
    "choice": lambda text: text in CHOICES,
    "grammar": lambda text: re.fullmatch(r"\(\d+(\+\d+)*\)", text) is not None,
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_folder())


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


def token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def allowed(state: GrammarState, vocab_size: int = VOCAB) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    state.fill_bitmask(bitmask, 0)
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab_size].nonzero().flatten().tolist())


def start(compiler: GrammarCompiler, kind: str) -> GrammarState:
    return compiler.start(compiler.compile(CASES[kind].spec))


@pytest.mark.parametrize("kind", CASES)
def test_the_mask_at_the_start_allows_a_valid_beginning_and_forbids_an_invalid_one(compiler, tokenizer, kind):
    mask = allowed(start(compiler, kind))
    assert token(tokenizer, CASES[kind].first) in mask
    assert token(tokenizer, CASES[kind].wrong) not in mask
    assert tokenizer.eos_token_id not in mask


@pytest.mark.parametrize("kind", CASES)
def test_a_valid_output_walked_through_ends_finished_with_only_eos_left(compiler, tokenizer, kind):
    state, ids = start(compiler, kind), tokenizer.encode(CASES[kind].valid, add_special_tokens=False)
    for position, token_id in enumerate(ids):
        assert not state.is_finished(), (kind, position)
        assert state.accept(token_id), (kind, position, tokenizer.decode([token_id]))
    assert state.is_finished()
    assert allowed(state) == {tokenizer.eos_token_id}
    assert state.accept(tokenizer.eos_token_id) and state.is_finished()
    assert allowed(state) == {tokenizer.eos_token_id}


@pytest.mark.parametrize("kind", CASES)
def test_an_invalid_token_is_refused_and_leaves_the_state_as_it_was(compiler, tokenizer, kind):
    state = start(compiler, kind)
    assert not state.accept(token(tokenizer, CASES[kind].wrong))
    assert not state.accept(tokenizer.eos_token_id)           # nothing is complete yet
    assert all(state.accept(t) for t in tokenizer.encode(CASES[kind].valid, add_special_tokens=False))
    assert state.is_finished()


@pytest.mark.parametrize("kind", CASES)
def test_pushed_tokens_are_taken_at_the_next_fill(compiler, tokenizer, kind):
    """The engine pushes each token; the matcher takes them when the next mask is filled, to the same state
    as accepting them at once."""
    ids = tokenizer.encode(CASES[kind].valid, add_special_tokens=False)[:3]
    pushed, accepted = start(compiler, kind), start(compiler, kind)
    for token_id in ids:
        pushed.push(token_id)
        assert accepted.accept(token_id)
    assert allowed(pushed) == allowed(accepted)


def test_a_forbidden_pushed_token_raises_at_the_next_fill_and_every_one_after(compiler, tokenizer):
    state = start(compiler, "regex")
    state.push(token(tokenizer, CASES["regex"].wrong))          # no check yet: that runs later
    for _ in range(2):
        with pytest.raises(GrammarViolation, match="forbids it"):
            allowed(state)


def test_a_complete_output_that_may_go_on_is_not_finished(compiler, tokenizer):
    state = compiler.start(compiler.compile(StructuredOutput("regex", "[0-9]+")))
    assert state.accept(token(tokenizer, "1")) and not state.is_finished()
    assert {tokenizer.eos_token_id, token(tokenizer, "2")} <= allowed(state)


def sample(compiler: GrammarCompiler, tokenizer, kind: str, seed: int, steps: int = 20) -> str:
    """`steps` tokens drawn from uniform logits under the mask, then, where the output is not finished
    (JSON may go on forever), the first allowed of some closing tokens (else the lowest allowed id)."""
    state, ids, generator = start(compiler, kind), [], torch.Generator().manual_seed(seed)
    for _ in range(steps):
        if state.is_finished():
            break
        logits = torch.zeros(1, VOCAB)
        compiler.mask(logits, [state])
        ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
        assert state.accept(ids[-1])
    closers = [tokenizer.eos_token_id] + [token(tokenizer, c) for c in ('"', "}", "]", ":", "0", ")")]
    for _ in range(100):
        if state.is_finished():
            break
        mask = allowed(state)
        ids.append(next((c for c in closers if c in mask), min(mask)))
        assert state.accept(ids[-1])
    assert state.is_finished()
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", CASES)
def test_random_sampling_under_the_mask_yields_valid_output(compiler, tokenizer, kind):
    outputs = [sample(compiler, tokenizer, kind, seed) for seed in range(3)]
    assert all(VALID[kind](text) for text in outputs), outputs


@pytest.mark.parametrize("kind,spec,problem", [
    ("json_schema", '{"type": ', "invalid JSON schema: not JSON: Expecting value at line 1 column 10"),
    ("json_schema", '{"type": "foo"}', 'invalid JSON schema: Unsupported type "foo"'),
    ("regex", "a(b", "invalid regex: .*parenthesis is not closed"),
    ("grammar", 'root ::= "a" |', "invalid grammar: EBNF parser error at line 1"),
    ("grammar", 'start ::= "a"', 'invalid grammar: .*root rule with name "root" is not found'),
])
def test_an_invalid_spec_is_a_value_error_naming_the_problem(compiler, kind, spec, problem):
    with pytest.raises(ValueError, match=problem):
        compiler.compile(StructuredOutput(kind, spec))


def test_the_message_of_an_invalid_spec_is_bounded(compiler):
    with pytest.raises(ValueError) as error:
        compiler.compile(StructuredOutput("json_schema", json.dumps({"type": "x" * 5000})))
    assert str(error.value).startswith("invalid JSON schema: ")
    assert len(str(error.value)) <= len("invalid JSON schema: ") + MAX_ERROR_CHARS


def test_the_cache_returns_the_same_grammar_for_the_same_spec(compiler):
    first = compiler.compile(StructuredOutput("choice", ("a", "b")))
    assert compiler.compile(StructuredOutput("choice", ("a", "b"))) is first
    assert compiler.compile(StructuredOutput("choice", ("b", "a"))) is not first


def test_the_cache_is_bounded_and_one_compile_wins_a_race(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, cache_size=1)
    specs = [StructuredOutput("regex", pattern) for pattern in ("a+", "b+")]
    first = compiler.compile(specs[0])
    compiler.compile(specs[1])
    assert compiler.compile(specs[0]) is not first          # evicted
    results, spec = [], StructuredOutput("json_schema", json.dumps(SCHEMA))
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(result is results[0] for result in results)


def test_a_fork_goes_its_own_way(compiler, tokenizer):
    parent = start(compiler, "choice")
    child = parent.fork()
    assert all(child.accept(t) for t in tokenizer.encode("yes", add_special_tokens=False))
    assert child.is_finished() and not parent.is_finished()
    assert all(parent.accept(t) for t in tokenizer.encode("no", add_special_tokens=False))
    assert parent.is_finished()


def test_rows_without_a_grammar_are_untouched(compiler, tokenizer):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    bitmask = torch.zeros(3, VOCAB // 32, dtype=torch.int32)         # rows 0 and 2 would forbid everything
    state = start(compiler, "regex")
    state.fill_bitmask(bitmask, 1)
    masked = logits.clone()
    apply_bitmask(masked, bitmask, torch.tensor([1]))
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    keep = sorted(allowed(state))
    assert torch.equal(masked[1, keep], logits[1, keep])
    assert masked[1].isinf().sum() == VOCAB - len(keep)
    by_compiler = logits.clone()
    compiler.mask(by_compiler, [None, state, None])
    assert torch.equal(by_compiler, masked)


def test_padded_vocabulary_ids_are_never_allowed(tokenizer):
    padded = len(tokenizer) + 64
    compiler = GrammarCompiler(tokenizer, padded)
    state = compiler.compile(StructuredOutput("json_object"))
    mask = allowed(compiler.start(state), padded)
    assert mask and max(mask) < len(tokenizer)
    logits = torch.zeros(1, padded)
    compiler.mask(logits, [compiler.start(state)])
    assert logits[0, len(tokenizer):].isinf().all()


def test_a_bitmask_narrower_than_the_logits_is_refused():
    with pytest.raises(ValueError, match="a bitmask of 32 tokens cannot mask 33 logits"):
        apply_bitmask(torch.zeros(1, 33), allocate_bitmask(1, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_are_masked_as_on_the_cpu():
    """On the tiny model's tokenizer (the GPU machine lacks the default model's package), with 44 logits
    past its vocabulary, which are masked too."""
    tiny = AutoTokenizer.from_pretrained(resolve_model(TINY_MODEL).folder)
    compiler = GrammarCompiler(tiny, len(tiny) + 44)
    logits = torch.randn(4, compiler.vocab_size, generator=torch.Generator().manual_seed(1))
    grammars = [start(compiler, "json_object"), None, start(compiler, "regex"), None]
    on_cpu, on_cuda = logits.clone(), logits.cuda()
    compiler.mask(on_cpu, grammars)
    compiler.mask(on_cuda, grammars)
    assert torch.equal(on_cuda.cpu(), on_cpu)
