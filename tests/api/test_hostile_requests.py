"""Hostile request bodies at the HTTP boundary: out-of-range sampling values, huge lists, lone surrogates, the
shared tokenizer pool (bounded, cancellable), engine failures mapped to the right status, and the max_tokens
default under --max-tokens-limit."""
import asyncio
import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from conftest import BASE_MODEL, assert_error_shape, in_process_client, start_server
from starlette.requests import Request

from slora.api.async_engine import EngineInfo
from slora.api.errors import APIError
from slora.api.limits import Admission
from slora.api.metrics import ServerMetrics
from slora.api.protocol import CompletionRequest
from slora.api.serving import GenerationService
from slora.api.settings import ServerSettings
from slora.api.tenants import Tenant
from slora.api.tokenizer_pool import Tokenization, TokenizationCancelled
from slora.api.tokenizing import encode_texts
from slora.config import EngineConfig
from slora.core.outputs import RequestError, RequestOutput
from slora.engine import Engine
from slora.models.builtin import TINY_MODEL

MAX_TOKENS_LIMIT = 5
MESSAGES = [{"role": "user", "content": "Hello there"}]
FAST_S = 30.0          # generous for a loaded 2-core machine; the unbounded versions took minutes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("logs"), "--max-tokens-limit", str(MAX_TOKENS_LIMIT))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert_error_shape(body, status)
    return body["error"]


def completion(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/v1/completions", json={"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 2, **fields})


def chat(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": BASE_MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                   **fields})


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    out = completion(http, temperature=0)
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] >= 1


# ---- sampling values the engine cannot take ------------------------------------------------------------
OUT_OF_RANGE = {
    "seed-2**63": ({"seed": 2 ** 63}, "seed"),
    "seed-below-int64": ({"seed": -2 ** 63 - 1}, "seed"),
    "seed-plus-n-overflows": ({"seed": 2 ** 63 - 1, "n": 2}, "seed"),
    "seed-2**64": ({"seed": 2 ** 64}, "seed"),
    "top_k-2**63": ({"top_k": 2 ** 63}, "top_k"),
    "top_k-2**31": ({"top_k": 2 ** 31}, "top_k"),
    "top_k-below-minus-one": ({"top_k": -2}, "top_k"),
}


@pytest.mark.parametrize("route", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_out_of_range_seed_and_top_k_are_400_naming_the_field(http, route, case):
    fields, param = OUT_OF_RANGE[case]
    error = error_of(route(http, temperature=1.0, **fields))
    assert error["param"] == param and param in error["message"], error
    assert_still_serving(http)


def test_the_largest_seeds_are_served(http):
    for fields in ({"seed": 2 ** 63 - 2, "n": 2}, {"seed": -2 ** 63}, {"top_k": 2 ** 31 - 1}):
        response = completion(http, temperature=1.0, **fields)
        assert response.status_code == 200, (fields, response.text)


# ---- sizes checked before any tokenizer work ---------------------------------------------------------
def timed(send) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = send()
    return response, time.monotonic() - start


def test_700000_prompts_get_a_fast_400_and_others_are_not_held_up(server):
    body = {"model": BASE_MODEL, "prompt": ["a"] * 700_000, "max_tokens": 1}
    with server.http() as big, server.http() as small, ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(timed, lambda: big.post("/v1/completions", json=body))
        time.sleep(0.05)
        unrelated = pool.submit(timed, lambda: completion(small, prompt="Hi there", max_tokens=1, temperature=0))
        (response, hostile_s), (other, other_s) = hostile.result(), unrelated.result()
    error = error_of(response)
    assert error["param"].startswith("prompt") and "1024" in error["message"], error
    assert hostile_s < FAST_S, hostile_s
    assert other.status_code == 200, other.text
    assert other_s < FAST_S, other_s


def test_100000_chat_messages_get_a_fast_400(http):
    response, seconds = timed(lambda: chat(http, messages=[{"role": "user", "content": "a"}] * 100_000))
    error = error_of(response)
    assert error["param"] == "messages" and "1024" in error["message"], error
    assert seconds < FAST_S, seconds


def test_prompts_times_n_is_checked_on_the_raw_prompt_list(http):
    error = error_of(completion(http, prompt=["a"] * 40, n=2))      # the default max_choices is 64
    assert error["param"] == "n" and "64" in error["message"] and "40 x 2" in error["message"], error


def test_total_prompt_characters_are_bounded(http):
    half = "word " * 120_000                                        # 600,000 characters each
    error = error_of(completion(http, prompt=[half, half]))
    assert error["param"] == "prompt" and "1000000" in error["message"], error
    assert "max_prompt_chars" in error["message"]
    long_messages = [{"role": "user", "content": half}, {"role": "assistant", "content": [{"type": "text",
                                                                                           "text": half}]}]
    error = error_of(chat(http, messages=long_messages))
    assert error["param"] == "messages" and "1200000" in error["message"], error


@pytest.mark.parametrize("prompt", ["", ["ok", ""], [[1], []]])
def test_an_empty_text_prompt_is_400_as_the_schema_says(http, prompt):
    assert error_of(completion(http, prompt=prompt))["param"].startswith("prompt")
    schema = http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
    assert '"minLength": 1' in json.dumps(schema["properties"]["prompt"])


def test_broken_json_is_400_without_a_byte_offset_as_param(http):
    response = http.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    error = error_of(response)
    assert error["param"] is None and "not valid JSON" in error["message"], error


def test_too_many_stop_token_ids_are_400(http):
    for count in (1025, 1_200_000):
        response, seconds = timed(lambda: completion(http, stop_token_ids=[5] * count))
        error = error_of(response)
        assert error["param"] == "stop_token_ids" and "1024" in error["message"], error
        assert seconds < FAST_S, seconds
    error = error_of(completion(http, stop_token_ids=[2 ** 31]))
    assert error["param"] == "stop_token_ids.0", error
    assert completion(http, stop_token_ids=[5] * 1024).status_code == 200


# ---- text that is not Unicode ------------------------------------------------------------------------
SURROGATES = {          # raw JSON: the escape decodes to a lone surrogate, which no encoder takes
    "prompt": ('/v1/completions', '{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt.text"),
    "prompt-list": ('/v1/completions', '{"model": "%s", "prompt": ["ok", "\\udfff"], "max_tokens": 2}',
                    "prompt.texts.1"),
    "message": ('/v1/chat/completions', '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}',
                "messages.0.content.string"),
    "stop": ('/v1/completions', '{"model": "%s", "prompt": "hi", "stop": "\\ud83d"}', "stop.string"),
    "user": ('/v1/completions', '{"model": "%s", "prompt": "hi", "user": "x\\udc00"}', "user"),
}


@pytest.mark.parametrize("case", sorted(SURROGATES))
def test_a_lone_surrogate_is_400_naming_the_field(http, case):
    route, body, param = SURROGATES[case]
    response = http.post(route, content=(body % BASE_MODEL).encode(), headers={"content-type": "application/json"})
    error = error_of(response)
    assert error["param"] == param and "surrogate" in error["message"], error


def test_valid_non_ascii_text_is_served(http):
    body = '{"model": "%s", "prompt": "caf\\u00e9 \\ud83d\\ude00", "max_tokens": 2}' % BASE_MODEL
    response = http.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


# ---- fields accepted only at their neutral value -------------------------------------------------------
def test_neutral_values_of_unsupported_fields_are_accepted(http):
    neutral = dict(suffix="", use_beam_search=False, skip_special_tokens=True, include_stop_str_in_output=False,
                   allowed_token_ids=[], bad_words=[], priority=0, length_penalty=1)
    assert completion(http, **neutral).status_code == 200
    assert chat(http, logprobs=False, top_logprobs=0, logit_bias=None, audio=None, web_search_options=None,
                modalities=["text"]).status_code == 200


@pytest.mark.parametrize("field,value", [("suffix", "end"), ("skip_special_tokens", False),
                                         ("include_stop_str_in_output", True), ("allowed_token_ids", [5])])
def test_other_values_of_unsupported_fields_are_400(http, field, value):
    error = error_of(completion(http, **{field: value}))
    assert error["param"] == field and "not supported" in error["message"], error


def test_a_priority_under_first_come_first_served_is_400_naming_the_policy(http):
    error = error_of(completion(http, priority=1))
    assert error["param"] == "priority" and "--scheduling-policy" in error["message"], error
    assert completion(http, priority=0).status_code == 200


# ---- max_tokens under --max-tokens-limit ---------------------------------------------------------------
def test_chat_without_max_tokens_is_capped_by_the_limit(http):
    response = http.post("/v1/chat/completions", json={"model": BASE_MODEL, "messages": MESSAGES, "temperature": 0,
                                                       "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT
    assert body["choices"][0]["finish_reason"] == "length"
    error = error_of(chat(http, max_tokens=MAX_TOKENS_LIMIT + 1))
    assert error["param"] == "max_tokens" and str(MAX_TOKENS_LIMIT) in error["message"], error


# ---- the tokenizer pool --------------------------------------------------------------------------------
class SlowTokenizer:
    """Takes `delay_s` per prompt and records which object encoded on which thread."""

    chat_template = None

    def __init__(self, delay_s: float, calls: list) -> None:
        self.delay_s = delay_s
        self.calls = calls          # shared by the copies: (id of the copy, thread name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((id(self), threading.current_thread().name))
        time.sleep(self.delay_s)
        return [len(text)]

    def apply_chat_template(self, conversation, **kwargs):
        raise NotImplementedError

    def __deepcopy__(self, memo):
        return SlowTokenizer(self.delay_s, self.calls)


def encode_work(texts):
    return lambda own, cancelled: encode_texts(own, texts, cancelled)


def with_pool(scenario, gate: threading.Event | None = None, **settings):
    """`scenario(pool)` on a fresh event loop with a new pool; the gate opens and the pool closes however the
    scenario ends (a failed assertion must not leave a thread waiting on the gate)."""
    async def run():
        pool = Tokenization(**settings)
        try:
            return await scenario(pool)
        finally:
            if gate is not None:
                gate.set()
            pool.close()
    return asyncio.run(run())


def test_pool_gives_each_worker_its_own_tokenizer_copy():
    calls: list = []
    source = SlowTokenizer(0.05, calls)

    async def scenario():
        pool = Tokenization(workers=2, max_pending=8, retry_after_s=1)
        try:
            results = await asyncio.gather(*(pool.run("t", source, encode_work(["ab", "abc"])) for _ in range(6)))
        finally:
            pool.close()
        assert results == [[[2], [3]]] * 6
    asyncio.run(scenario())
    copies = {copy_id for copy_id, _ in calls}
    threads = {thread for _, thread in calls}
    assert id(source) not in copies                         # the API's tokenizer itself is never used
    assert len(threads) == 2 and len(copies) == 2           # one copy per worker thread, kept between requests
    assert all(t.startswith("slora-tokenize") for t in threads)


def test_pool_queue_overflow_is_429_with_retry_after():
    source, order, gate = SlowTokenizer(0, []), [], threading.Event()

    async def scenario(pool: Tokenization):
        running = [asyncio.ensure_future(pool.run(tenant, source, gated(gate, order, tenant)))
                   for tenant in "abc"]
        await until(lambda: pool.waiting == 2)            # one runs, two wait (one tenant may have one)
        with pytest.raises(APIError) as info:
            await pool.run("d", source, encode_work(["x"]))
        assert info.value.status == 429 and info.value.headers["Retry-After"] == "3"
        assert "queue is full" in info.value.message, info.value.message
        gate.set()
        assert await asyncio.gather(*running) == ["a", "b", "c"]      # the admitted ones are all served
        assert pool.waiting == 0
        assert await pool.run("d", source, encode_work(["xy"])) == [[2]]
    with_pool(scenario, gate, workers=1, max_pending=2, retry_after_s=3)


def test_pool_cancellation_frees_the_queue_and_the_thread():
    calls: list = []
    source = SlowTokenizer(0.05, calls)

    async def scenario(pool: Tokenization):
        hostile = asyncio.ensure_future(pool.run("t", source, encode_work(["a"] * 1000)))  # 50 s if not stopped
        queued = asyncio.ensure_future(pool.run("t", source, encode_work(["b"] * 1000)))
        await until(lambda: pool.waiting == 1)
        queued.cancel()                                   # its client left while it waited
        await asyncio.gather(queued, return_exceptions=True)
        assert pool.waiting == 0
        hostile.cancel()                                  # its client left while it was tokenized
        await asyncio.gather(hostile, return_exceptions=True)
        start = time.monotonic()
        assert await pool.run("t", source, encode_work(["abcd"])) == [[4]]
        return time.monotonic() - start
    waited_s = with_pool(scenario, workers=1, max_pending=4, retry_after_s=1)
    assert waited_s < FAST_S / 3, waited_s
    assert len(calls) < 200, len(calls)                      # the 1000-prompt work stopped early
    assert len(calls) >= 2                                   # and it did start


def gated(gate: threading.Event, order: list, label: str):
    """Work that records `label` and then holds its thread until `gate` is set."""
    def work(own, cancelled):
        order.append(label)
        assert gate.wait(FAST_S), "the test never opened the gate"
        return label
    return work


def recorded(order: list, label: str):
    return lambda own, cancelled: order.append(label) or label


async def until(condition, timeout_s: float = FAST_S) -> None:
    """Yields to the loop one turn at a time until `condition()` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0)


def test_pool_serves_waiting_tenants_in_turn():
    # The one thread is busy; tenant a queues 5 requests, then tenant b queues 1: b's runs second, right after
    # a's first, not behind all five of a's.
    source, order, gate = SlowTokenizer(0, []), [], threading.Event()

    async def scenario(pool: Tokenization):
        busy = asyncio.ensure_future(pool.run("c", source, gated(gate, order, "c")))
        await until(lambda: order == ["c"])
        of_a = [asyncio.ensure_future(pool.run("a", source, recorded(order, f"a{i}"))) for i in range(1, 6)]
        await until(lambda: pool.waiting_of("a") == 5)
        of_b = asyncio.ensure_future(pool.run("b", source, recorded(order, "b1")))
        await until(lambda: pool.waiting == 6)
        gate.set()
        await asyncio.wait_for(asyncio.gather(busy, of_b, *of_a), FAST_S)
    with_pool(scenario, gate, workers=1, max_pending=12, retry_after_s=1)
    assert order == ["c", "a1", "b1", "a2", "a3", "a4", "a5"], order


def test_pool_per_tenant_bound_is_429_while_another_tenant_gets_in():
    source, order, gate = SlowTokenizer(0, []), [], threading.Event()

    async def scenario(pool: Tokenization):
        assert pool.max_pending_per_tenant == 2
        busy = asyncio.ensure_future(pool.run("a", source, gated(gate, order, "busy")))
        await until(lambda: order == ["busy"])
        admitted = [asyncio.ensure_future(pool.run("a", source, recorded(order, "a"))) for _ in range(2)]
        await until(lambda: pool.waiting_of("a") == 2)
        with pytest.raises(APIError) as info:
            await pool.run("a", source, recorded(order, "a over"))
        assert info.value.status == 429 and info.value.headers["Retry-After"] == "3"
        assert "per-tenant" in info.value.message, info.value.message
        admitted += [asyncio.ensure_future(pool.run("b", source, recorded(order, "b"))) for _ in range(2)]
        await until(lambda: pool.waiting == 4)              # b got in although a is at its bound
        with pytest.raises(APIError) as info:
            await pool.run("c", source, recorded(order, "c over"))
        assert info.value.status == 429 and "queue is full" in info.value.message, info.value.message
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(busy, *admitted), FAST_S) == ["busy", "a", "a", "b", "b"]
    with_pool(scenario, gate, workers=1, max_pending=4, retry_after_s=3)
    assert sorted(order) == ["a", "a", "b", "b", "busy"], order


def test_pool_cancelled_waiter_frees_its_place_and_the_pool_still_serves():
    source, order, gate = SlowTokenizer(0, []), [], threading.Event()

    async def scenario(pool: Tokenization):
        busy = asyncio.ensure_future(pool.run("x", source, gated(gate, order, "busy")))
        await until(lambda: order == ["busy"])
        leaving = asyncio.ensure_future(pool.run("a", source, recorded(order, "left")))
        await until(lambda: pool.waiting_of("a") == 1)
        with pytest.raises(APIError):                     # a is at its bound of one
            await pool.run("a", source, recorded(order, "a over"))
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        assert pool.waiting == 0
        again = asyncio.ensure_future(pool.run("a", source, recorded(order, "a")))   # its place is free
        await until(lambda: pool.waiting_of("a") == 1)
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(busy, again), FAST_S) == ["busy", "a"]
        await one_thread_still_serves(pool, source)
    with_pool(scenario, gate, workers=1, max_pending=2, retry_after_s=1)
    assert "left" not in order, order


def test_pool_a_waiter_cancelled_as_it_is_handed_the_thread_passes_it_on():
    source, order, gate = SlowTokenizer(0, []), [], threading.Event()

    async def scenario(pool: Tokenization):
        busy = asyncio.ensure_future(pool.run("x", source, gated(gate, order, "busy")))
        await until(lambda: order == ["busy"])
        leaving = asyncio.ensure_future(pool.run("a", source, recorded(order, "left")))
        after = asyncio.ensure_future(pool.run("b", source, recorded(order, "b")))
        await until(lambda: pool.waiting == 2)
        gate.set()
        await until(lambda: pool.waiting_of("a") == 0)    # a was handed the thread but has not resumed yet
        leaving.cancel()
        assert await asyncio.wait_for(after, FAST_S) == "b"           # the thread went on to b
        await asyncio.gather(leaving, return_exceptions=True)
        assert leaving.cancelled() and await busy == "busy"
        await one_thread_still_serves(pool, source)
    with_pool(scenario, gate, workers=1, max_pending=4, retry_after_s=1)
    assert "left" not in order, order


async def one_thread_still_serves(pool: Tokenization, source) -> None:
    """Exactly one thread is free: one request runs, the next waits for it, and both are served."""
    order, gate = [], threading.Event()
    try:
        first = asyncio.ensure_future(pool.run("y", source, gated(gate, order, "first")))
        second = asyncio.ensure_future(pool.run("z", source, recorded(order, "second")))
        await until(lambda: order == ["first"] and pool.waiting == 1)   # not two threads
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(first, second), FAST_S) == ["first", "second"]
    finally:
        gate.set()


def test_a_client_that_leaves_frees_the_tokenizer_thread():
    # The service's own wiring: a non-streamed request whose client disconnects while its 1000 prompts are
    # tokenized (50 s of work) is answered 499 at once, and the one thread it held is free again.
    calls: list = []
    info = EngineInfo("base", 2048, 32000, SlowTokenizer(0.05, calls))
    engine = SimpleNamespace(info=info, accepting=True)
    settings = ServerSettings(max_choices=1024)
    pool = Tokenization(workers=1, max_pending=4, retry_after_s=1)
    service = GenerationService(engine, settings, Admission(16, 1), ServerMetrics(), pool)

    async def leaves_after(seconds: float) -> dict:
        await asyncio.sleep(seconds)
        return {"type": "http.disconnect"}

    async def scenario() -> float:
        request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                          lambda: leaves_after(0.3))
        body = CompletionRequest(model="base", prompt=["a"] * 1000)
        response = await asyncio.wait_for(service.completions(body, Tenant("t"), request), FAST_S)
        assert response.status_code == 499
        start = time.monotonic()
        assert await pool.run("t", info.tokenizer, encode_work(["abc"])) == [[3]]
        return time.monotonic() - start
    try:
        waited_s = asyncio.run(scenario())
    finally:
        pool.close()
    assert waited_s < FAST_S / 3, waited_s
    assert 2 <= len(calls) < 200, len(calls)


def test_cancelled_work_stops_between_prompts():
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(TokenizationCancelled):
        encode_texts(SlowTokenizer(0, []), ["a", "b"], cancelled)


# ---- engine failures of one request --------------------------------------------------------------------
@pytest.fixture(scope="module")
def failing_app(tmp_path_factory):
    """An in-process server whose engine fails every request it runs with `mode["code"]` (as the engine does
    when an adapter's files changed, or a fault hits one request); None lets requests run normally."""
    engine = Engine(EngineConfig(TINY_MODEL, num_pages=64))
    mode = {"code": None}
    real_step = engine.step

    def step() -> list[RequestOutput]:
        outputs = real_step()
        if mode["code"] is None:
            return outputs
        return [fail(engine, out, mode["code"]) for out in outputs]
    engine.step = step
    settings = ServerSettings(adapter_store=str(tmp_path_factory.mktemp("adapter-store")))
    with in_process_client(engine, settings) as client:
        yield client, mode, engine


def fail(engine: Engine, output: RequestOutput, code: str) -> RequestOutput:
    final = engine.abort(output.request_id) or output          # frees its pages, like the engine's own path
    samples = [dataclasses.replace(o, finish_reason="error") for o in final.outputs]
    error = RequestError(code, "reading /srv/secret/adapter failed: weights changed")
    return dataclasses.replace(final, outputs=samples, finished=True, error=error)


def sse_payloads(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("code,status", [("adapter_unavailable", 409), ("internal_error", 500)])
def test_engine_failures_map_to_their_status(failing_app, code, status):
    client, mode, engine = failing_app
    mode["code"] = code
    try:
        body = {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code and "/srv/secret" not in error["message"], error
        if code == "adapter_unavailable":
            assert "load the adapter again" in error["message"] and error["param"] == "model"
            assert "shutting down" not in error["message"]
        streamed = client.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200
        payloads = sse_payloads(streamed.text)
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["error"]["code"] == code
    finally:
        mode["code"] = None
    assert client.post("/v1/completions", json=body).status_code == 200      # the engine still serves
    assert client.get("/health").json() == {"status": "ok"}
    assert engine.pool_stats()["kv_pages"] == 0


def test_work_stopped_by_close_is_503_not_500():
    """A request still being tokenized when the server shuts down is told so (503), not given a 500."""
    source = SlowTokenizer(0.05, [])

    async def scenario():
        pool = Tokenization(workers=1, max_pending=4, retry_after_s=1)
        running = asyncio.ensure_future(pool.run("t", source, encode_work(["a"] * 1000)))
        await asyncio.sleep(0.3)
        pool.close()
        with pytest.raises(APIError) as refused:
            await asyncio.wait_for(running, FAST_S)
        return refused.value
    error = asyncio.run(scenario())
    assert error.status == 503 and "shutting down" in error.message


@pytest.mark.parametrize("name", ["abc\n", "abc\ndef", "-lead", "a" * 129, "sp ace"])
def test_adapter_names_outside_the_pattern_are_refused(name):
    from slora.api.adapter_files import check_adapter_name
    with pytest.raises(APIError) as refused:
        check_adapter_name(name, BASE_MODEL)
    assert refused.value.status == 400 and refused.value.param == "name"
