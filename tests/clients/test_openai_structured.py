"""The openai client's structured output helpers against `slora serve`: `chat.completions.parse` (or
`beta.chat.completions.parse` in older clients) and `chat.completions.stream` with a pydantic class as
`response_format`. The client sends it as a strict json_schema (the enum as a $ref into $defs); the server
constrains the sampling by its grammar, so that even the small default model's answer parses, also where the
schema leaves out the answer it would give unconstrained ("green")."""
import enum
import json

import openai
import pytest
from pydantic import BaseModel

from slora.models.builtin import DEFAULT_MODEL

QUESTION = [{"role": "user", "content": "What colour is fresh grass? Answer in JSON."}]
MAX_TOKENS = 64             # bounded: the JSON of the schema takes about 20 tokens


class Colour(str, enum.Enum):
    red = "red"
    blue = "blue"
    yellow = "yellow"


class Answer(BaseModel):
    colour: Colour
    certain: bool


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def parse(client: openai.OpenAI):
    """`chat.completions.parse` where the client has it (openai >= 1.92), else the beta one it replaced."""
    completions = client.chat.completions
    return getattr(completions, "parse", None) or client.beta.chat.completions.parse


def test_parse_returns_an_object_of_the_pydantic_class(client):
    completion = parse(client)(model=DEFAULT_MODEL, messages=QUESTION, response_format=Answer,
                               max_tokens=MAX_TOKENS, temperature=0)
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Answer), choice.message
    assert choice.message.refusal is None
    assert json.loads(choice.message.content) == choice.message.parsed.model_dump(mode="json")


def test_the_streaming_helper_parses_the_same_answer(client):
    with client.chat.completions.stream(model=DEFAULT_MODEL, messages=QUESTION, response_format=Answer,
                                        max_tokens=MAX_TOKENS, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, Answer) and "".join(deltas) == final.choices[0].message.content
    whole = parse(client)(model=DEFAULT_MODEL, messages=QUESTION, response_format=Answer, max_tokens=MAX_TOKENS,
                          temperature=0)
    assert parsed == whole.choices[0].message.parsed        # greedy: streamed or not, the same tokens
