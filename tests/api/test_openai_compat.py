"""OpenAI-compatible routes against a real server: same tokens as the offline LLM, streaming, n, seed,
stop, usage, models, errors, metrics, disconnects."""
import json
import threading

import httpx
import openai
import pytest
from conftest import BASE_MODEL, assert_error_shape, chat_ids, greedy, start_server, stream_completion

PROMPT = "Hello, how are you?"
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hello there"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(shared_server, adapter_root):
    """The session's server of these arguments, test_adapters_api.py's too: no test here depends on a fresh
    one (counters are compared before and after, the pool waited for idle). It must exit 0 (shared_server)."""
    srv = shared_server(start_server, "--adapter-root", str(adapter_root))
    for name in ("attn-r4", "all-r16"):                  # the test adapters, loaded through the API
        with srv.http() as http:
            assert http.post("/v1/adapters", json={"name": name, "path": name}).status_code == 200
    return srv


MODELS = [BASE_MODEL, "demo-r4-attn", "all-r16"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completion_matches_offline(client, offline, model, stream):
    adapter = None if model == BASE_MODEL else model
    expected = greedy(offline, [PROMPT], adapter, MAX_TOKENS)[0]
    if stream:
        text, tokens, reason = stream_completion(client, model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                 temperature=0)
    else:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"return_token_ids": True})
        choice = out.choices[0]
        text, tokens, reason = choice.text, choice.token_ids, choice.finish_reason
        assert out.usage.prompt_tokens == len(offline.encode(PROMPT))
        assert out.usage.completion_tokens == len(expected.token_ids)
        assert out.model == model and out.object == "text_completion"
    assert tokens == expected.token_ids
    assert text == expected.text
    assert reason == expected.finish_reason


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_matches_offline(client, offline, model, stream):
    adapter = None if model == BASE_MODEL else model
    prompt = chat_ids(offline, MESSAGES)
    expected = greedy(offline, [prompt], adapter, MAX_TOKENS)[0]
    if stream:
        text, tokens, reason, roles = "", [], None, []
        for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True,
                                                    extra_body={"return_token_ids": True}):
            assert chunk.object == "chat.completion.chunk"
            for choice in chunk.choices:
                roles += [choice.delta.role] if choice.delta.role else []
                text += choice.delta.content or ""
                tokens += getattr(choice, "token_ids", None) or []
                reason = choice.finish_reason or reason
        assert roles == ["assistant"]
    else:
        out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert choice.message.role == "assistant"
        text, tokens, reason = choice.message.content, choice.token_ids, choice.finish_reason
        assert choice.prompt_token_ids == prompt
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == len(tokens)
    assert tokens == expected.token_ids
    assert text == expected.text
    assert reason == expected.finish_reason


def test_token_prompts_and_prompt_lists(client, offline):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    expected = greedy(offline, prompts, "demo-r16-all", 4)
    out = client.completions.create(model="demo-r16-all", prompt=prompts, max_tokens=4, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.token_ids for c in out.choices] == [e.token_ids for e in expected]
    assert out.usage.prompt_tokens == 7


def test_n_samples_follow_the_seed(client):
    kwargs = dict(model=BASE_MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=123)
    first = client.completions.create(n=3, **kwargs, extra_body={"return_token_ids": True})
    again = client.completions.create(n=3, **kwargs, extra_body={"return_token_ids": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    # Sample i uses seed + i: it equals the same request alone with that seed.
    alone = client.completions.create(**{**kwargs, "seed": 124}, extra_body={"return_token_ids": True})
    assert alone.choices[0].token_ids == first.choices[1].token_ids
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.choices)


def test_stop_string_cuts_text_streamed_and_not(client, offline):
    full = greedy(offline, [PROMPT], None, 16, ignore_eos=True)[0].text
    start = next(i for i in range(3, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].isprintable())
    stop = full[start:start + 2]
    expected = full[:full.index(stop)]
    out = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    text, _, reason = stream_completion(client, model=BASE_MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                        stop=stop, user="user-1", extra_body={"ignore_eos": True})
    assert text == expected and reason == "stop"


def test_include_usage_sends_a_final_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 4


def test_models_list_base_and_adapters(client):
    models = {m.id: m for m in client.models.list()}
    assert models[BASE_MODEL].parent is None
    assert {"demo-r4-attn", "demo-r8-mlp", "demo-r16-all", "attn-r4", "all-r16"} <= set(models)
    assert models["attn-r4"].parent == BASE_MODEL and models["attn-r4"].owned_by
    assert client.models.retrieve("attn-r4").id == "attn-r4"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


BAD_REQUESTS = {
    "n-too-large": dict(n=1000),
    "max-tokens-over-context": dict(max_tokens=5000),
    "max-tokens-negative": dict(max_tokens=-1),
    "negative-temperature": dict(temperature=-1),
    "top-p-zero": dict(top_p=0),
    "too-many-stops": dict(stop=["a", "b", "c", "d", "e"]),
    "suffix": dict(suffix="and then"),
    "prompt-too-long": dict(prompt=[5] * 2100),
    "token-out-of-vocab": dict(prompt=[10 ** 6]),
    "empty-prompt": dict(prompt=""),
    "logprobs-too-many": dict(logprobs=21),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_invalid_requests_are_400_with_openai_shape(client, case):
    kwargs = {"model": BASE_MODEL, "prompt": PROMPT, "max_tokens": 4, **BAD_REQUESTS[case]}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    assert_error_shape(info.value.response.json(), 400)
    assert info.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nobody-has-this", messages=MESSAGES, max_tokens=2)
    assert_error_shape(info.value.response.json(), 404)
    assert info.value.body["code"] == "model_not_found"


def test_malformed_and_oversized_bodies(server):
    with server.http() as http:
        for response in (http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                         http.post("/v1/chat/completions", json={"model": BASE_MODEL, "messages": []})):
            assert response.status_code == 400, response.text
            assert_error_shape(response.json(), 400)
        too_large = http.post("/v1/completions", json={"model": BASE_MODEL, "prompt": "x" * (5 * 2 ** 20)})
        assert too_large.status_code == 413, too_large.text
        assert_error_shape(too_large.json(), 413)
        assert too_large.json()["error"]["code"] == "request_too_large"
        missing = http.get("/v1/nothing-here")
        assert missing.status_code == 404
        assert_error_shape(missing.json(), 404)


def test_metrics_parse_and_counters_move(server, client):
    before = server.metrics()
    client.completions.create(model="demo-r4-attn", prompt=PROMPT, max_tokens=3, temperature=0)
    after = server.metrics()
    assert after['slora_requests_total{outcome="ok"}'] >= before.get('slora_requests_total{outcome="ok"}', 0) + 1
    assert after["slora_generation_tokens_total"] >= before["slora_generation_tokens_total"] + 1
    assert after["slora_prompt_tokens_total"] > before["slora_prompt_tokens_total"]
    assert after["slora_time_to_first_token_seconds_count"] >= before["slora_time_to_first_token_seconds_count"] + 1
    assert after["slora_e2e_request_latency_seconds_count"] >= before["slora_e2e_request_latency_seconds_count"] + 1
    for name in ('slora_pool_pages{owner="free"}', 'slora_pool_pages{owner="kv"}', 'slora_pool_pages{owner="cached"}',
                 'slora_pool_pages{owner="adapter"}', "slora_sequences_running", "slora_sequences_waiting",
                 "slora_preemptions_total", "slora_adapter_pool_loads_total", "slora_adapter_pool_evictions_total",
                 'slora_adapters{tier="pool"}', 'slora_adapters{tier="host"}', "slora_adapter_load_seconds_count",
                 "slora_time_per_output_token_seconds_count"):
        assert name in after, name
    assert after["slora_adapter_load_seconds_count"] >= 2        # the two loads of the fixture
    prefill_steps = 'slora_engine_steps_total{kind="prefill"}'
    assert after[prefill_steps] >= before.get(prefill_steps, 0) + 1   # the request's prompt went through a step
    assert after['slora_engine_step_seconds_total{kind="prefill"}'] > 0
    assert after["slora_engine_decode_bytes_total"] > before["slora_engine_decode_bytes_total"]   # 2 decode steps
    assert server.log().count('"event": "request"') >= 1
    assert PROMPT not in server.log()                             # request logs never hold prompt text


def _idle(samples):
    return samples['slora_pool_pages{owner="kv"}'] == 0 and samples["slora_engine_requests"] == 0


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    body = {"model": "demo-r8-mlp", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            busy = server.metrics()
            assert busy['slora_pool_pages{owner="kv"}'] > 0
    # 1500 tokens would take minutes: only an abort frees the pages this fast.
    server.wait_for(_idle, timeout_s=10, what="pages freed after disconnect")


def test_disconnect_while_waiting_for_a_json_answer_aborts(server):
    body = {"model": BASE_MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    server.wait_for(_idle, timeout_s=10, what="pages freed after a non-streamed disconnect")
    assert '"outcome": "disconnected"' in server.log()


def test_32_streams_over_mixed_adapters_with_8_closed(server, offline):
    models = [BASE_MODEL, "demo-r4-attn", "demo-r8-mlp", "all-r16"]
    prompts = [f"Request {i}: tell me about slora" for i in range(32)]
    closed = set(range(0, 32, 4))         # 8 clients go away after their first chunk
    expected = {}
    for model in models:
        mine = [i for i in range(32) if models[i % 4] == model and i not in closed]
        adapter = None if model == BASE_MODEL else model
        outs = greedy(offline, [prompts[i] for i in mine], adapter, 6)
        expected.update({i: o for i, o in zip(mine, outs)})
    results, errors = {}, []

    def run(i: int) -> None:
        try:
            with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
                stream = c.completions.create(model=models[i % 4], prompt=prompts[i], temperature=0,
                                              max_tokens=1000 if i in closed else 6, stream=True,
                                              extra_body={"return_token_ids": True,
                                                          "ignore_eos": i in closed})
                tokens, text, reason = [], "", None
                for chunk in stream:
                    for choice in chunk.choices:
                        tokens += choice.token_ids or []
                        text += choice.text
                        reason = choice.finish_reason or reason
                    if i in closed and tokens:
                        stream.close()
                        return
                results[i] = (tokens, text, reason)
        except Exception as exc:  # collected and reported by the main thread
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert sorted(results) == sorted(set(range(32)) - closed)
    for i, (tokens, text, reason) in results.items():
        assert tokens == expected[i].token_ids, i
        assert text == expected[i].text and reason == expected[i].finish_reason, i
    server.wait_for(_idle, timeout_s=15, what="no KV page held after the 32 streams")
    with server.http() as http:
        assert http.get("/health").json() == {"status": "ok"}


def test_engine_keeps_serving_after_errors(client, offline):
    # A burst of bad requests mixed with good ones leaves the server consistent.
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=BASE_MODEL, prompt=[10 ** 6], max_tokens=2)
    out = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == greedy(offline, [PROMPT], None, 3)[0].token_ids


def test_error_event_shape_is_json():
    # The error SSE event is plain JSON with the OpenAI error object (what the client raises from).
    from slora.api.errors import unavailable
    event = unavailable("shutting down").sse_event()
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert_error_shape(json.loads(event[len("data: "):]), 503)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_usage_reports_prefix_cache_hits(client, stream):
    first_token = 5 + 100 * stream                        # a prompt of its own for each case
    prompt = list(range(first_token, first_token + 70))   # 4 full pages of 16 tokens, then 6 more
    kwargs = dict(model="demo-r8-mlp", prompt=prompt, max_tokens=2, temperature=0)
    assert client.completions.create(**kwargs).usage.prompt_tokens_details.cached_tokens == 0
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        usage = client.completions.create(**kwargs).usage
    assert usage.prompt_tokens == 70
    assert usage.prompt_tokens_details.cached_tokens == 64
