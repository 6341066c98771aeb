"""Logprobs in the answers: OpenAI's legacy completions format, echo (lm-eval's loglikelihood requests),
chat's format, vLLM's prompt_logprobs, streamed as well as not, and usage on every chunk with
continuous_usage_stats. In-process (TestClient) over a real tiny engine whose outputs are recorded, so every
number the server reports is checked against the engine's own output objects."""
import json
import math

import openai
import pytest
from conftest import BASE_MODEL, in_process_client

from slora.api.responses import LOGPROB_FLOOR, logprob_value
from slora.api.settings import ServerSettings
from slora.config import EngineConfig
from slora.engine import Engine
from slora.models.builtin import TINY_MODEL

PROMPT = "Hello, how are you?"
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(client, finals, engine): finals maps engine request ids to their final RequestOutput."""
    engine = Engine(EngineConfig(TINY_MODEL, num_pages=128))
    finals: dict = {}
    real_step = engine.step

    def step():
        outputs = real_step()
        finals.update((out.request_id, out) for out in outputs if out.finished)
        return outputs
    engine.step = step
    settings = ServerSettings(adapter_store=str(tmp_path_factory.mktemp("adapter-store")))
    with in_process_client(engine, settings) as client:
        yield client, finals, engine


def post(client, route: str, **fields) -> dict:
    defaults = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    response = client.post(f"/v1/{route}", json={"model": BASE_MODEL, "temperature": 0, **defaults, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def events(client, route: str, **fields) -> list[dict]:
    defaults = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    response = client.post(f"/v1/{route}", json={"model": BASE_MODEL, "temperature": 0, "stream": True, **defaults,
                                                 **fields})
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


def text_of(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def assert_legacy_logprobs(logprobs: dict, token_ids: list[int], entries: list, top: int, engine: Engine,
                           offset: int = 0) -> None:
    """`logprobs` (OpenAI's legacy format) shows these tokens with the engine's TokenLogprob entries (None: a
    prompt's first token)."""
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert logprobs["tokens"] == [text_of(engine, t) for t in token_ids]
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(token_ids)
    for position, entry in enumerate(entries):
        value, best = logprobs["token_logprobs"][position], logprobs["top_logprobs"][position]
        if entry is None:
            assert value is None and best is None
            continue
        assert value == pytest.approx(entry.logprob, abs=1e-6)
        expected = {text_of(engine, t): v for t, v in reversed(entry.top[:top])}
        expected.setdefault(text_of(engine, entry.token_id), entry.logprob)
        assert best.keys() == expected.keys() and len(best) <= top + 1
        assert all(best[k] == pytest.approx(expected[k], abs=1e-6) for k in best)
    offsets = [offset]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets


# ---- completions ---------------------------------------------------------------------------------------
def test_completion_logprobs_are_the_engines(app):
    """Needs the engine side (logprobs in CompletionOutput)."""
    client, finals, engine = app
    body = post(client, "completions", max_tokens=5, logprobs=2, ignore_eos=True)
    sample = finals[f"{body['id']}-0"].outputs[0]
    assert len(sample.logprobs) == 5
    assert_legacy_logprobs(body["choices"][0]["logprobs"], sample.token_ids, sample.logprobs, 2, engine)
    for position, entry in enumerate(sample.logprobs):          # greedy: the token is the most likely one
        best = body["choices"][0]["logprobs"]["top_logprobs"][position]
        assert max(best.values()) == pytest.approx(entry.logprob, abs=1e-6)


def test_no_logprobs_unless_asked(app):
    client, _, _ = app
    assert post(client, "completions", max_tokens=2)["choices"][0]["logprobs"] is None
    assert post(client, "chat/completions", max_tokens=2)["choices"][0]["logprobs"] is None


def test_echo_with_max_tokens_zero_is_the_prompt_and_its_logprobs(app):
    """What lm-eval's loglikelihood sends. Needs the engine side (prompt_logprobs, max_tokens=0)."""
    client, finals, engine = app
    body = post(client, "completions", max_tokens=0, echo=True, logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    out = finals[f"{body['id']}-0"]
    assert out.outputs[0].token_ids == [] and body["usage"]["completion_tokens"] == 0
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    assert_legacy_logprobs(choice["logprobs"], out.prompt_token_ids, out.prompt_logprobs, 1, engine)
    assert "prompt_logprobs" not in choice                       # only when asked for in vLLM's form


def test_echo_of_token_prompts_as_lm_eval_sends_them(app):
    """Context + continuation as token ids, two requests in one, logprobs 1: the continuation's loglikelihood and
    whether greedy decoding would produce it. Needs the engine side."""
    client, finals, engine = app
    contexts = [engine.tokenizer.encode("The capital of France"), engine.tokenizer.encode("Once upon")]
    continuations = [engine.tokenizer.encode(" is Paris"), engine.tokenizer.encode(" a time")]
    prompts = [c + k for c, k in zip(contexts, continuations)]
    body = post(client, "completions", prompt=prompts, max_tokens=0, echo=True, logprobs=1, seed=1234)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for index, (choice, prompt, context) in enumerate(zip(body["choices"], prompts, contexts)):
        out = finals[f"{body['id']}-{index}"]
        assert choice["text"] == engine.tokenizer.decode(prompt)
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt)
        assert_legacy_logprobs(logprobs, prompt, out.prompt_logprobs, 1, engine)
        continuation = logprobs["token_logprobs"][len(context):]
        expected = sum(entry.logprob for entry in out.prompt_logprobs[len(context):])
        assert sum(continuation) == pytest.approx(expected, abs=1e-4)
        greedy = all(entry.rank == 1 for entry in out.prompt_logprobs[len(context):])
        tops = logprobs["top_logprobs"][len(context):]
        assert greedy == all(value >= max(top.values()) - 1e-6 for value, top in zip(continuation, tops))


def test_echo_with_generated_tokens_puts_the_prompt_first(app):
    """Needs the engine side."""
    client, finals, engine = app
    body = post(client, "completions", prompt=[5, 6, 7, 8], max_tokens=3, echo=True, logprobs=2, ignore_eos=True)
    choice, out = body["choices"][0], finals[f"{body['id']}-0"]
    sample = out.outputs[0]
    assert choice["text"] == engine.tokenizer.decode([5, 6, 7, 8]) + sample.text
    assert_legacy_logprobs(choice["logprobs"], out.prompt_token_ids + sample.token_ids,
                           out.prompt_logprobs + sample.logprobs, 2, engine)
    plain = post(client, "completions", prompt=[5, 6, 7, 8], max_tokens=3, echo=True, ignore_eos=True)
    assert plain["choices"][0]["text"] == choice["text"] and plain["choices"][0]["logprobs"] is None


def test_streamed_completion_logprobs_add_up_to_the_whole(app):
    """Needs the engine side."""
    client, _, _ = app
    whole = post(client, "completions", max_tokens=6, logprobs=1, echo=True, ignore_eos=True)["choices"][0]
    chunks = events(client, "completions", max_tokens=6, logprobs=1, echo=True, ignore_eos=True)
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += choice["text"]
            for key in merged:
                merged[key] += choice["logprobs"][key]
    assert text == whole["text"]
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["text_offset"] == whole["logprobs"]["text_offset"]
    assert merged["token_logprobs"] == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-5)


def test_streamed_echo_with_max_tokens_zero(app):
    client, _, _ = app
    chunks = events(client, "completions", max_tokens=0, echo=True)
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == PROMPT
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tokens_as_token_ids(app):
    """Needs the engine side."""
    client, finals, _ = app
    body = post(client, "completions", max_tokens=3, logprobs=1, return_tokens_as_token_ids=True, ignore_eos=True)
    sample = finals[f"{body['id']}-0"].outputs[0]
    assert body["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in sample.token_ids]


def test_vllm_prompt_logprobs(app):
    """Needs the engine side."""
    client, finals, engine = app
    for route in ("completions", "chat/completions"):
        body = post(client, route, max_tokens=2, prompt_logprobs=2)
        out = finals[f"{body['id']}-0"]
        shown = body["choices"][0]["prompt_logprobs"] if route == "completions" else body["prompt_logprobs"]
        assert len(shown) == len(out.prompt_token_ids) and shown[0] is None
        for token_id, position, entry in zip(out.prompt_token_ids[1:], shown[1:], out.prompt_logprobs[1:]):
            own = position[str(token_id)]
            assert own["rank"] == entry.rank and own["decoded_token"] == text_of(engine, token_id)
            assert own["logprob"] == pytest.approx(entry.logprob, abs=1e-6)
            for rank, (candidate, value) in enumerate(entry.top[:2], 1):
                assert position[str(candidate)]["logprob"] == pytest.approx(value, abs=1e-6)
                assert position[str(candidate)]["rank"] in (rank, entry.rank)
            assert len(position) <= 3


# ---- chat ----------------------------------------------------------------------------------------------
def test_chat_logprobs_are_the_engines(app):
    """Needs the engine side."""
    client, finals, engine = app
    body = post(client, "chat/completions", max_tokens=4, logprobs=True, top_logprobs=2, ignore_eos=True)
    sample = finals[f"{body['id']}-0"].outputs[0]
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(sample.token_ids) == 4
    for item, token_id, entry in zip(content, sample.token_ids, sample.logprobs):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["token"] == text_of(engine, token_id) and item["bytes"] == list(item["token"].encode())
        assert item["logprob"] == pytest.approx(entry.logprob, abs=1e-6)
        assert [t["token"] for t in item["top_logprobs"]] == [text_of(engine, t) for t, _ in entry.top[:2]]
        assert [t["logprob"] for t in item["top_logprobs"]] == pytest.approx([v for _, v in entry.top[:2]], abs=1e-6)
    no_top = post(client, "chat/completions", max_tokens=2, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [item["top_logprobs"] for item in no_top] == [[], []]


def test_the_openai_client_parses_chat_logprobs(app):
    """Needs the engine side."""
    client, _, _ = app
    # Over the module's TestClient (an httpx client), which closing this client would close: it is left open.
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    out = oa.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                     logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(item.top_logprobs) == 2 for item in content)
    assert all(isinstance(item.logprob, float) and item.bytes is not None for item in content)
    streamed = [item for chunk in oa.chat.completions.create(
                    model=BASE_MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                    top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
                for choice in chunk.choices if choice.logprobs for item in choice.logprobs.content or []]
    assert [item.token for item in streamed] == [item.token for item in content]
    legacy = oa.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                   temperature=0)
    assert legacy.choices[0].text == PROMPT and legacy.choices[0].logprobs.token_logprobs[0] is None


# ---- usage on every chunk ------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_continuous_usage_stats_put_usage_on_every_chunk(app, route):
    client, _, _ = app
    chunks = events(client, route, max_tokens=4, ignore_eos=True, n=2,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert chunks[-1]["choices"] == []                         # include_usage's last chunk is still there
    final = chunks[-1]["usage"]
    assert final["completion_tokens"] == 8
    seen = [chunk["usage"] for chunk in chunks]
    assert all(u["prompt_tokens"] == final["prompt_tokens"] for u in seen)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in seen)
    counts = [u["completion_tokens"] for u in seen]
    assert counts == sorted(counts) and counts[-2] == 8
    alone = events(client, route, max_tokens=2, stream_options={"continuous_usage_stats": True})
    assert all(chunk["usage"] is not None and chunk["choices"] for chunk in alone)   # no final usage chunk


def test_logprobs_that_json_cannot_carry_are_floored():
    assert logprob_value(-math.inf) == LOGPROB_FLOOR and logprob_value(math.nan) == LOGPROB_FLOOR
    assert logprob_value(-1e6) == LOGPROB_FLOOR and logprob_value(-0.5) == -0.5
