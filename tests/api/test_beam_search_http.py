"""Beam search over HTTP, as vLLM's server exposes it (use_beam_search, best_of as the width, length_penalty,
early_stopping): the choices are the offline LLM's beams token for token, streamed whole at the search's end;
what beam search does not combine with is a 400 naming the field; the width counts against a tenant's
max_concurrent. In-process (TestClient) over a real tiny engine, whose add_request records what it was given."""
import json

import pytest
from conftest import BASE_MODEL, assert_error_shape, chat_ids, in_process_client, record_requests
from servers import write_tenants

from slora import SamplingParams
from slora.api.jobs import Job
from slora.api.settings import ServerSettings
from slora.api.tenants import Tenant
from slora.config import EngineConfig
from slora.engine import Engine
from slora.models.builtin import TINY_MODEL

MAX_BEAM_WIDTH = 4               # the engine's max_beam_width here: below the server's max_n (16)
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello there"}]
KEYS = {"acme": "beam-acme-key", "small": "beam-small-key"}
SMALL_MAX_CONCURRENT = 3
# n=2 best of 4 beams; ignore_eos, so that every beam runs max_tokens and the test does not hang on the model.
BEAM = {"use_beam_search": True, "n": 2, "best_of": 4, "temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(client, records): records gets (prompt ids, SamplingParams) of every engine request."""
    folder = tmp_path_factory.mktemp("beam-search")
    tenants = write_tenants(folder, {"acme": {"key": KEYS["acme"]},
                                     "small": {"key": KEYS["small"], "max_concurrent": SMALL_MAX_CONCURRENT,
                                               "max_queued": 8}})
    engine = Engine(EngineConfig(TINY_MODEL, num_pages=64, max_beam_width=MAX_BEAM_WIDTH))
    records = record_requests(engine)
    settings = ServerSettings(tenants_file=str(tenants), adapter_store=str(folder / "adapter-store"))
    with in_process_client(engine, settings) as client:
        yield client, records


def completion(client, key: str = "acme", **fields):
    return client.post("/v1/completions", headers={"Authorization": f"Bearer {KEYS[key]}"},
                       json={"model": BASE_MODEL, "prompt": PROMPT, **BEAM, "return_token_ids": True, **fields})


def chat(client, **fields):
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['acme']}"},
                       json={"model": BASE_MODEL, "messages": MESSAGES, **BEAM, "return_token_ids": True, **fields})


def ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def error_of(response, param: str) -> dict:
    assert response.status_code == 400, response.text
    assert_error_shape(response.json(), 400)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error


def sse_payloads(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.fixture(scope="module")
def expected(offline):
    """The offline LLM's beams of BEAM for the completion prompt and for the chat's, with 2 logprobs each."""
    params = SamplingParams(use_beam_search=True, beam_width=4, n=2, temperature=0, max_tokens=6, ignore_eos=True,
                            logprobs=2)
    completion_out, chat_out = offline.generate([PROMPT, chat_ids(offline, MESSAGES)], params)
    for out in (completion_out, chat_out):
        assert len(out.outputs) == 2 and out.outputs[0].token_ids != out.outputs[1].token_ids
    return {"completion": completion_out.outputs, "chat": chat_out.outputs}


# ---- the beams --------------------------------------------------------------------------------------------
def test_completion_choices_are_the_offline_beams(app, expected):
    client, records = app
    body = ok(completion(client))
    beams = expected["completion"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["token_ids"] for c in body["choices"]] == [b.token_ids for b in beams]
    assert [c["text"] for c in body["choices"]] == [b.text for b in beams]
    assert [c["finish_reason"] for c in body["choices"]] == [b.finish_reason for b in beams] == ["length"] * 2
    assert body["usage"]["completion_tokens"] == 12
    _, params = records[-1]
    assert params.use_beam_search and params.beam_width == 4 and params.best_of is None and params.n == 2
    assert params.num_samples == 4


def test_the_width_is_n_without_best_of_and_tuning_reaches_the_engine(app):
    client, records = app
    ok(completion(client, best_of=None, n=3, temperature=None, length_penalty=0.5, early_stopping="never"))
    _, params = records[-1]
    assert params.beam_width == 3 and params.n == 3 and params.temperature == 1.0   # the HTTP default: accepted
    assert params.length_penalty == 0.5 and params.early_stopping == "never"
    body = ok(completion(client, early_stopping=True))
    assert len(body["choices"]) == 2 and records[-1][1].early_stopping is True
    ok(completion(client, use_beam_search=None, best_of=None, length_penalty=None, early_stopping=None))
    _, params = records[-1]                            # nulls stand for the defaults: no beam search
    assert not params.use_beam_search and params.num_samples == 2 and params.length_penalty == 1.0


def test_streamed_beams_arrive_whole_at_the_end(app, expected):
    client, _ = app
    response = completion(client, stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200, response.text
    assert response.text.endswith("data: [DONE]\n\n"), response.text[-200:]
    events = sse_payloads(response.text)
    with_choices = [e for e in events if e["choices"]]
    assert len(with_choices) == 2                      # one chunk per beam: nothing is known before the end
    choices = sorted((c for e in with_choices for c in e["choices"]), key=lambda c: c["index"])
    beams = expected["completion"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [(c["text"], c["token_ids"], c["finish_reason"]) for c in choices] == \
        [(b.text, b.token_ids, b.finish_reason) for b in beams]
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_chat_choices_are_the_offline_beams_streamed_or_not(app, expected):
    client, _ = app
    beams = expected["chat"]
    body = ok(chat(client))
    assert [c["message"]["content"] for c in body["choices"]] == [b.text for b in beams]
    assert [c["token_ids"] for c in body["choices"]] == [b.token_ids for b in beams]
    response = chat(client, stream=True)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n"), response.text[-200:]
    content = {0: "", 1: ""}
    reasons = {}
    for event in sse_payloads(response.text):
        for choice in event["choices"]:
            content[choice["index"]] += choice["delta"].get("content") or ""
            reasons[choice["index"]] = choice["finish_reason"] or reasons.get(choice["index"])
    assert content == {0: beams[0].text, 1: beams[1].text} and reasons == {0: "length", 1: "length"}


def test_logprobs_are_each_beams_own(app, expected):
    client, _ = app
    body = ok(completion(client, logprobs=2))
    for choice, beam in zip(body["choices"], expected["completion"], strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 6
        assert logprobs["token_logprobs"] == pytest.approx([t.logprob for t in beam.logprobs], abs=1e-4)
        assert sum(logprobs["token_logprobs"]) == pytest.approx(beam.cumulative_logprob, abs=1e-3)
        # The 2 most likely there, and the beam's own token when it is not one of them (a beam may take any).
        for top, value in zip(logprobs["top_logprobs"], logprobs["token_logprobs"], strict=True):
            assert 2 <= len(top) <= 3 and max(top.values()) >= value, top
    body = ok(completion(client, logprobs=1, echo=True))          # the prompt's logprobs come first
    prompt_tokens = body["usage"]["prompt_tokens"]
    for choice, beam in zip(body["choices"], expected["completion"], strict=True):
        assert choice["text"] == PROMPT + beam.text
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == prompt_tokens + 6 and token_logprobs[0] is None
    body = ok(chat(client, logprobs=True, top_logprobs=2))
    for choice, beam in zip(body["choices"], expected["chat"], strict=True):
        content = choice["logprobs"]["content"]
        assert [t["logprob"] for t in content] == pytest.approx([t.logprob for t in beam.logprobs], abs=1e-4)
        assert all(len(t["top_logprobs"]) == 2 for t in content)


# ---- refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,param,words", [
    ({"top_p": 0.5}, "top_p", "top_p"),
    ({"temperature": 0.5}, "temperature", "temperature"),
    ({"stop": ["fox"]}, "stop", "stop"),
    ({"min_tokens": 1}, "min_tokens", "min_tokens"),
    ({"logit_bias": {"5": 1}}, "logit_bias", "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format", "structured output"),
    ({"guided_regex": "a+"}, "guided_regex", "structured output"),
    ({"max_tokens": 0}, "max_tokens", "use_beam_search"),
    ({"best_of": 5}, "best_of", f"max_beam_width={MAX_BEAM_WIDTH}"),
    ({"best_of": None, "n": 5}, "n", f"max_beam_width={MAX_BEAM_WIDTH}"),
    ({"best_of": 17}, "best_of", "16"),                              # the server's --max-n bounds the width
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty", "without use_beam_search"),
    ({"use_beam_search": False, "early_stopping": True}, "early_stopping", "without use_beam_search"),
    ({"length_penalty": 11}, "length_penalty", "10"),
])
def test_what_beam_search_cannot_do_is_400_naming_the_field(app, fields, param, words):
    client, records = app
    before = len(records)
    error = error_of(completion(client, **fields), param)
    assert words in error["message"], error
    if "max_beam_width" not in words:                  # refused before the engine saw it (the engine bounds widths)
        assert len(records) == before


def test_a_forced_tool_call_is_a_structured_output_beam_search_refuses(app):
    client, _ = app
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    error = error_of(chat(client, tools=[tool], tool_choice="required"), "tool_choice")
    assert "structured output" in error["message"], error


# ---- seats ----------------------------------------------------------------------------------------------------
def test_a_beam_search_holds_prompts_times_width_seats():
    params = SamplingParams(use_beam_search=True, beam_width=4, n=2, max_tokens=5)
    job = Job(kind="completion", model="m", adapter=None, tenant=Tenant("t"), prompts=[[1, 2]] * 3, params=params,
              stream=False, include_usage=False, return_token_ids=False, user=None)
    assert job.seats == 12
    assert job.token_reservation(True) == 6 + 12 * 5           # max_tokens for every beam, not every choice


def test_a_width_over_the_tenants_max_concurrent_is_refused(app):
    client, _ = app
    error = error_of(completion(client, key="small"), "n")
    assert error["code"] == "request_too_large" and "4 sequences" in error["message"], error
    error = error_of(completion(client, key="small", prompt=[PROMPT, PROMPT], best_of=2), "n")
    assert "4 sequences" in error["message"], error
    assert len(ok(completion(client, key="small", best_of=SMALL_MAX_CONCURRENT))["choices"]) == 2
