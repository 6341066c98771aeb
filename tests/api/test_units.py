"""The service's parts without a server: admission, tenants file, metrics text, stream text deltas, the
default chat template, and the engine thread's failure and stall detection."""
import asyncio
import copy
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slora.api.async_engine import AsyncEngine, EngineUnavailable
from slora.api.errors import APIError
from slora.api.limits import Admission
from slora.api.metrics import ServerMetrics
from slora.api.settings import ServerSettings
from slora.api.stream_events import ChoiceProgress, withhold
from slora.api.tenants import Tenant, hash_key, load_tenants
from slora.api.tokenizing import render_chat
from slora.config import EngineConfig
from slora.engine import Engine
from slora.models.builtin import TINY_MODEL
from slora.sampling.params import SamplingParams


def test_admission_queues_hands_over_and_refuses():
    async def scenario():
        admission = Admission(max_pending=3, retry_after_s=2)
        acme = Tenant("acme", max_concurrent=1, max_queued=1)
        await admission.acquire(acme, 1)
        waiter = asyncio.ensure_future(admission.acquire(acme, 1))
        await asyncio.sleep(0)
        assert admission.queued == 1 and not waiter.done()
        with pytest.raises(APIError) as info:                 # queue full
            await admission.acquire(acme, 1)
        assert info.value.status == 429 and info.value.headers["Retry-After"] == "2"
        admission.release(acme, 1)                            # hands the slot to the waiter
        await waiter
        assert admission.queued == 0 and admission.pending == 1
        free = Tenant("free")
        await admission.acquire(free, 1)
        await admission.acquire(free, 1)
        with pytest.raises(APIError):                         # server-wide bound
            await admission.acquire(free, 1)
    asyncio.run(scenario())


def test_cancelled_waiter_leaves_no_trace():
    async def scenario():
        admission = Admission(max_pending=10, retry_after_s=1)
        acme = Tenant("acme", max_concurrent=1, max_queued=2)
        await admission.acquire(acme, 1)
        waiter = asyncio.ensure_future(admission.acquire(acme, 1))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert admission.pending == 1 and admission.queued == 0
        admission.release(acme, 1)
        assert admission.pending == 0
    asyncio.run(scenario())


def test_tenants_file_validation(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(f'[tenants.a]\nrole = "admin"\nkey_sha256 = "{hash_key("k1")}"\n'
                    f'[tenants.b]\nkey_sha256 = ["{hash_key("k2")}"]\nmax_concurrent = 2\nmax_adapters = 3\n')
    directory = load_tenants(good)
    assert directory.get("b").max_adapters == 3 and directory.get("a").max_adapters is None
    assert directory.authenticate("k1").is_admin and directory.authenticate("k2").id == "b"
    assert directory.authenticate("wrong") is None and directory.authenticate(None) is None
    for text, words in (('[tenants.a]\nkey_sha256 = "plain-key"\n', "64 hex"),
                        (f'[tenants.a]\nrole = "root"\nkey_sha256 = "{hash_key("x")}"\n', "role"),
                        (f'[tenants.a]\nkey_sha256 = "{hash_key("x")}"\nmax_concurrent = 0\n', "max_concurrent"),
                        (f'[tenants.a]\nkey_sha256 = "{hash_key("x")}"\nmax_adapters = 0\n', "max_adapters"),
                        (f'[tenants.a]\nkey_sha256 = "{hash_key("x")}"\nmax_adapters = "5"\n', "max_adapters"),
                        (f'[tenants.a]\nkey_sha256 = "{hash_key("x")}"\nmax_tokens_per_minute = 0\n',
                         "max_tokens_per_minute"),
                        (f'[tenants.a]\nkey_sha256 = "{hash_key("x")}"\n[tenants.b]\nkey_sha256 = "{hash_key("x")}"\n',
                         "same key"),
                        ("[tenants.a]\nkey = 1\n", "unknown field"), ("not toml =", "tenants file")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=words):
            load_tenants(bad)


def test_settings_refuse_open_single_user_mode():
    with pytest.raises(ValueError, match="allow-unauthenticated"):
        ServerSettings(host="0.0.0.0")
    assert ServerSettings(host="0.0.0.0", allow_unauthenticated=True).single_user
    assert ServerSettings(host="::1").host == "::1"
    with pytest.raises(ValueError, match="max_n"):
        ServerSettings(max_n=0)


def test_metrics_text_parses():
    metrics = ServerMetrics()
    metrics.requests.labels(outcome="ok").inc()
    metrics.errors.labels(status='4"0\\0').inc()             # label values are escaped
    metrics.ttft.observe(0.3)
    metrics.ttft.observe(100.0)

    class Idle:
        accepting, snapshot = True, None
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(Idle(), queued=0, inflight=0))}
    assert families["slora_requests"].type == "counter"
    ttft = {s.labels.get("le"): s.value for s in families["slora_time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")}
    assert ttft["0.5"] == 1 and ttft["+Inf"] == 2


def test_stream_deltas_withhold_partial_characters_and_stop_prefixes():
    assert withhold("abc\ufffd", []) == "abc"
    assert withhold("hello wo", ["world"]) == "hello "
    assert withhold("hello", ["xyz"]) == "hello"
    progress = ChoiceProgress()
    assert progress.advance("ab\ufffd", [1, 2], None, []) == ("ab", [1, 2], False)
    assert progress.advance("abé", [1, 2, 3], None, []) == ("é", [3], False)
    assert progress.advance("abé!", [1, 2, 3, 4], "length", []) == ("!", [4], True)


def test_default_chat_template_when_the_tokenizer_has_none():
    from slora.models.tiny import ensure_tiny_model
    from slora.models.tokenizer import load_tokenizer
    tokenizer = copy.deepcopy(load_tokenizer(ensure_tiny_model().model_dir))
    tokenizer.chat_template = None
    ids = render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tokenizer.decode(ids) == "<|user|>\nhi</s>\n<|assistant|>\n"


def test_engine_loop_failure_and_stall_are_unhealthy():
    engine = Engine(EngineConfig(TINY_MODEL, num_pages=64))
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(0.6)                   # a stalled step
            return real_step()
        raise RuntimeError("device lost")

    engine.step = failing_step

    async def scenario():
        front = AsyncEngine(engine)
        front.start()
        while front.state.value == "starting":
            await asyncio.sleep(0.01)
        assert front.health(stall_timeout_s=5) == (True, "ok")
        stream = await front.generate("r", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0), None, None)
        await asyncio.sleep(0.4)
        ok, reason = front.health(stall_timeout_s=0.2)
        assert not ok and "more than" in reason
        with pytest.raises(EngineUnavailable):
            async for _ in stream:
                pass
        ok, reason = front.health(stall_timeout_s=5)
        assert not ok
        with pytest.raises(EngineUnavailable):
            await front.generate("s", [5], SamplingParams(max_tokens=1), None, None)
        await front.shutdown(1)
    asyncio.run(scenario())


def test_a_long_engine_command_is_a_stall_too():
    """Commands (adapter registration, listings, anything run on the engine thread) hold up every step as a
    slow step does: /health must see them."""
    engine = Engine(EngineConfig(TINY_MODEL, num_pages=64))

    async def scenario():
        front = AsyncEngine(engine)
        front.start()
        while front.state.value == "starting":
            await asyncio.sleep(0.01)
        command = asyncio.ensure_future(front.call(lambda _: time.sleep(0.8)))
        await asyncio.sleep(0.5)
        ok, reason = front.health(stall_timeout_s=0.2)
        assert not ok and "more than" in reason
        await command
        assert front.health(stall_timeout_s=0.2) == (True, "ok")
        await front.shutdown(1)
    asyncio.run(scenario())


def test_token_bucket_refills_at_its_rate():
    from slora.api.limits import TokenBucket
    bucket = TokenBucket(capacity=120, tokens=120, updated=0.0)
    assert bucket.take(100, now=0.0) is None                    # 20 left
    assert bucket.take(50, now=0.0) == pytest.approx(15.0)      # 30 missing at 2 tokens/s
    assert bucket.take(50, now=15.0) is None                    # refilled 30 in 15 s
    assert bucket.take(10, now=1e6) is None and bucket.tokens == 110   # never above capacity


def test_token_reservations_are_settled_against_what_ran():
    admission = Admission(max_pending=100, retry_after_s=1)
    tenant = Tenant("t", max_tokens_per_minute=100)
    admission.charge_tokens(tenant, 80)
    admission.settle_tokens(tenant, 80, 0)                      # refused before it ran
    admission.charge_tokens(tenant, 90)                         # fits again: the 80 came back
    admission.settle_tokens(tenant, 90, 30)                     # used 30: 70 left
    admission.charge_tokens(tenant, 70)
    admission.settle_tokens(tenant, 70, 100)                    # used more than reserved: a debt of 30
    with pytest.raises(APIError, match="Token rate limit"):
        admission.charge_tokens(tenant, 1)
    with pytest.raises(APIError, match="Request too large") as too_large:
        admission.charge_tokens(tenant, 101)
    assert too_large.value.status == 400
