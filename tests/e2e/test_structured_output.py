"""Structured output through the engine on the default model (SmolLM2-135M, its real tokenizer): sampled
requests under several bounded JSON schemas, a regex, a choice and a grammar, mixed in one batch with
unconstrained ones, all parse and validate; the unconstrained outputs are those of the same requests run
alone. (An unbounded schema can outrun any max_tokens; that output is cut with finish_reason "length".)"""
import json
import re

import pytest

from slora import LLM, SamplingParams
from slora.sampling.structured_output import StructuredOutput

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["colour", "ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "maxItems": 3}}, "required": ["tags"]},
]
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{3}"
CHOICES = ("yes", "no", "maybe")
GRAMMAR = 'root ::= "(" digit+ ("+" digit+)* ")"\ndigit ::= [0-9]'
NUM_REQUESTS = 50


def validates(value: object, schema: dict) -> bool:
    """The few schema keywords used above, checked by hand."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        return isinstance(value, dict) and set(schema["required"]) <= set(value) \
            and set(value) <= set(schema["properties"]) \
            and all(validates(v, schema["properties"][k]) for k, v in value.items())
    if kind == "array":
        return isinstance(value, list) and len(value) <= schema["maxItems"] \
            and all(validates(v, schema["items"]) for v in value)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema["maxLength"]
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) \
            and schema["minimum"] <= value <= schema["maximum"]
    return isinstance(value, bool)


def request(i: int) -> tuple[str, StructuredOutput | None]:
    """Request i's instruction and structure: mostly schemas, some of each other kind, every fifth free."""
    kinds = [("Describe a person as JSON.", StructuredOutput("json_schema", json.dumps(SCHEMAS[0]))),
             ("Pick a colour, as JSON.", StructuredOutput("json_schema", json.dumps(SCHEMAS[1]))),
             ("Give some tags as JSON.", StructuredOutput("json_schema", json.dumps(SCHEMAS[2]))),
             ("Write a product code.", StructuredOutput("regex", REGEX)),
             ("Tell me a story.", None),
             ("Is the sky blue?", StructuredOutput("choice", CHOICES)),
             ("Add some numbers.", StructuredOutput("grammar", GRAMMAR)),
             ("Write a product code.", StructuredOutput("regex", REGEX)),
             ("Describe a person as JSON.", StructuredOutput("json_schema", json.dumps(SCHEMAS[0]))),
             ("Tell me a joke.", None)]
    return kinds[i % len(kinds)]


def check(text: str, structured: StructuredOutput) -> None:
    if structured.kind == "json_schema":
        assert validates(json.loads(text), json.loads(structured.spec)), text
    elif structured.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif structured.kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", text), text


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=64)


def prompt(llm: LLM, instruction: str) -> str:
    return llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": instruction}],
                                                    add_generation_prompt=True, tokenize=False)


def test_constrained_requests_mixed_with_free_ones_all_validate(llm):
    requests = [request(i) for i in range(NUM_REQUESTS)]
    prompts = [prompt(llm, instruction) for instruction, _ in requests]
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=i, structured=s)
              for i, (_, s) in enumerate(requests)]
    outputs = llm.generate(prompts, params)
    for out, (_, structured) in zip(outputs, requests):
        if structured is not None:
            assert out.finish_reason == "stop", (out.text, structured)
            check(out.text, structured)
    free = [i for i, (_, s) in enumerate(requests) if s is None]
    alone = llm.generate([prompts[i] for i in free], [params[i] for i in free])
    assert [o.token_ids for o in alone] == [outputs[i].token_ids for i in free]
    assert llm.pool_stats()["kv_pages"] == 0


def test_any_json_object(llm):
    """json_object bounds nothing, so an object may outrun max_tokens (greedy loops here); this seed closes it.
    Sampling on the CPU is deterministic."""
    out = llm.generate([prompt(llm, "Describe a cat as a JSON object.")],
                       SamplingParams(max_tokens=128, temperature=0.7, seed=1,
                                      structured=StructuredOutput("json_object")))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate([prompt(llm, "Is it raining?")],
                       SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=4,
                                      structured=StructuredOutput("choice", CHOICES)))[0]
    assert len(out.outputs) == 4 and all(c.text in CHOICES for c in out.outputs)


@pytest.mark.parametrize("structured, problem", [
    (StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'),
     "invalid JSON schema"),
    (StructuredOutput("json_schema", "{not json"), "invalid JSON schema"),
    (StructuredOutput("regex", "([a-z"), "invalid regex"),
    (StructuredOutput("grammar", "root ::= missing_rule"), "invalid grammar"),
])
def test_an_invalid_spec_is_refused_naming_the_problem(llm, structured, problem):
    with pytest.raises(ValueError, match=problem):
        llm.generate(["Hello"], SamplingParams(max_tokens=4, structured=structured))
    assert not llm.engine.has_unfinished() and llm.pool_stats()["kv_pages"] == 0


def test_a_complete_output_ends_at_its_eos_also_with_ignore_eos(llm):
    """The grammar's mask allows only EOS once the output is complete; that EOS ends the request, also with
    ignore_eos (the grammar cannot go on), long before max_tokens."""
    eos = llm.engine.tokenizer.eos_token_id
    for ignore_eos in (False, True):
        out = llm.generate([prompt(llm, "Is the sky blue?")],
                           SamplingParams(max_tokens=32, temperature=1.0, seed=5, ignore_eos=ignore_eos,
                                          structured=StructuredOutput("choice", CHOICES)))[0]
        assert out.finish_reason == "stop" and out.text in CHOICES, (ignore_eos, out.text)
        assert out.token_ids[-1] == eos and len(out.token_ids) < 32


def test_min_tokens_beyond_the_grammar_still_ends_when_only_the_end_is_left(llm):
    """min_tokens forbids EOS, but a complete choice allows nothing else: the request ends with its choice
    rather than sampling from a row of nothing."""
    out = llm.generate([prompt(llm, "Is the sky blue?")],
                       SamplingParams(max_tokens=32, min_tokens=20, temperature=1.0, seed=5,
                                      structured=StructuredOutput("choice", CHOICES)))[0]
    assert out.finish_reason == "stop" and out.text in CHOICES, out.text
    assert llm.pool_stats()["kv_pages"] == 0
