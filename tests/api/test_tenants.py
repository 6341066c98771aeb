"""Tenants: keys, roles, isolated adapter namespaces, public adapters and per-tenant limits."""
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from conftest import BASE_MODEL, assert_error_shape, free_port, greedy, start_server, write_tenants

PROMPT = "The quick brown fox"
KEYS = {"ops": "admin-key-123", "acme": "acme-key-456", "globex": "globex-key-789", "initech": "initech-key-000",
        "hooli": "hooli-key-111", "umbrella": "umbrella-key-222"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter_root):
    folder = tmp_path_factory.mktemp("tenants")
    tenants = write_tenants(folder, {
        "ops": {"key": KEYS["ops"], "role": "admin"},
        "acme": {"key": [KEYS["acme"], "acme-second-key"], "role": "tenant", "max_concurrent": 1, "max_queued": 1},
        "globex": {"key": KEYS["globex"]},
        "initech": {"key": KEYS["initech"], "max_adapters": 2},
        "hooli": {"key": KEYS["hooli"], "max_tokens_per_minute": 60},
        "umbrella": {"key": KEYS["umbrella"], "max_tokens_per_minute": 60}})
    srv = start_server(folder, "--tenants", str(tenants), "--adapter-root", str(adapter_root))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def clients(server):
    made = {name: server.client(key) for name, key in KEYS.items()}
    yield made
    for c in made.values():
        c.close()


@pytest.fixture(scope="module")
def https(server):
    made = {name: server.http(key) for name, key in KEYS.items()}
    yield made
    for h in made.values():
        h.close()


def tokens_of(client, model: str, max_tokens: int = 4) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                    extra_body={"return_token_ids": True})
    return out.choices[0].token_ids


def names(http) -> set[str]:
    return {a["name"] for a in http.get("/v1/adapters").json()["data"]}


def test_keys(server, clients):
    with server.client("wrong-key") as wrong, pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert_error_shape(info.value.response.json(), 401)
    response = httpx.get(f"{server.url}/v1/models")
    assert response.status_code == 401
    assert_error_shape(response.json(), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    with server.client("acme-second-key") as second:            # a tenant may have several keys
        assert BASE_MODEL in {m.id for m in second.models.list()}
    assert {m.id for m in clients["globex"].models.list()} >= {BASE_MODEL, "demo-r4-attn"}


@pytest.fixture(scope="module")
def support_bots(https):
    """One adapter name in two namespaces: acme's support-bot (attn-r4) and globex's (mlp-r8). A fixture, so
    that every test that needs them has them, whichever tests run before it."""
    for tenant, path in (("acme", "attn-r4"), ("globex", "mlp-r8")):
        response = https[tenant].post("/v1/adapters", json={"name": "support-bot", "path": path})
        assert response.status_code == 200, response.text


def test_same_name_in_two_namespaces(clients, offline, support_bots):
    assert tokens_of(clients["acme"], "support-bot") == greedy(offline, [PROMPT], "attn-r4", 4)[0].token_ids
    assert tokens_of(clients["globex"], "support-bot") == greedy(offline, [PROMPT], "mlp-r8", 4)[0].token_ids


def test_another_tenants_adapter_is_404_everywhere(https, clients, offline):
    acme, globex = https["acme"], https["globex"]
    assert acme.post("/v1/adapters", json={"name": "acme-secret", "path": "all-r16"}).status_code == 200
    expected = greedy(offline, [PROMPT], "all-r16", 4)[0].token_ids
    assert "acme-secret" not in names(globex)
    assert "acme-secret" not in {m.id for m in clients["globex"].models.list()}
    with pytest.raises(openai.NotFoundError) as foreign:
        clients["globex"].completions.create(model="acme-secret", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as missing:
        clients["globex"].completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    # Someone else's adapter answers exactly like one that does not exist.
    assert foreign.value.body["message"].replace("acme-secret", "X") == \
        missing.value.body["message"].replace("no-such-adapter", "X")
    for response in (globex.delete("/v1/adapters/acme-secret"),
                     globex.delete("/v1/adapters/acme-secret", params={"owner": "acme"}),
                     globex.post("/v1/unload_lora_adapter", json={"lora_name": "acme-secret"}),
                     globex.post("/v1/adapters", json={"name": "acme-secret", "path": "mlp-r8", "owner": "acme"})):
        assert response.status_code == 404, response.text
        assert_error_shape(response.json(), 404)
    # Loading the same name in one's own namespace does not touch the other tenant's adapter.
    assert globex.post("/v1/adapters", json={"name": "acme-secret", "path": "mlp-r8"}).status_code == 200
    assert tokens_of(clients["acme"], "acme-secret") == expected
    assert globex.delete("/v1/adapters/acme-secret").status_code == 200
    assert tokens_of(clients["acme"], "acme-secret") == expected


def test_public_adapters_are_published_by_admins_only(https, clients, offline):
    refused = https["acme"].post("/v1/adapters", json={"name": "mine-public", "path": "attn-r4", "public": True})
    assert refused.status_code == 403
    assert_error_shape(refused.json(), 403)
    assert https["ops"].post("/v1/adapters", json={"name": "shared", "path": "mlp-r8", "public": True}).status_code == 200
    expected = greedy(offline, [PROMPT], "mlp-r8", 4)[0].token_ids
    shared = {a["name"]: a for a in https["acme"].get("/v1/adapters").json()["data"]}["shared"]
    assert shared["public"] is True and shared["owner"] is None          # the admin's id is not shown
    for tenant in ("acme", "globex"):
        assert "shared" in {m.id for m in clients[tenant].models.list()}
        assert tokens_of(clients[tenant], "shared") == expected
        assert https[tenant].delete("/v1/adapters/shared").status_code == 404
        assert https[tenant].delete("/v1/adapters/demo-r4-attn").status_code == 404
    assert https["ops"].delete("/v1/adapters/shared").status_code == 200
    with pytest.raises(openai.NotFoundError):
        clients["acme"].completions.create(model="shared", prompt=PROMPT, max_tokens=2)


def test_admin_sees_and_manages_every_namespace(https, support_bots):
    listed = https["ops"].get("/v1/adapters").json()["data"]
    owners = {(a["name"], a["owner"]) for a in listed}
    assert ("support-bot", "acme") in owners and ("support-bot", "globex") in owners
    assert https["ops"].post("/v1/adapters", json={"name": "for-acme", "path": "attn-r4", "owner": "acme"}
                             ).status_code == 200
    assert "for-acme" in names(https["acme"]) and "for-acme" not in names(https["globex"])
    assert https["ops"].delete("/v1/adapters/for-acme", params={"owner": "acme"}).status_code == 200
    assert "for-acme" not in names(https["acme"])
    assert https["ops"].post("/v1/adapters", json={"name": "x", "path": "attn-r4", "owner": "nobody"}
                             ).status_code == 400


def test_over_the_limit_is_429_with_retry_after(server, clients, https):
    # acme: 1 running + 1 queued. A long stream takes the slot, a second request queues, a third is refused.
    stream = clients["acme"].completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=1500, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    queued_result = {}

    def queued() -> None:
        with server.client(KEYS["acme"]) as c:
            queued_result["out"] = c.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=2)
    thread = threading.Thread(target=queued)
    thread.start()
    server.wait_for(lambda s: s["slora_requests_queued"] == 1, what="a queued request")
    with pytest.raises(openai.RateLimitError) as info:
        clients["acme"].completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=2)
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert_error_shape(info.value.response.json(), 429)
    assert tokens_of(clients["globex"], BASE_MODEL, 2)            # other tenants are not limited by acme's
    stream.close()                                                 # frees the slot: the queued one runs
    thread.join(timeout=60)
    assert queued_result["out"].usage.completion_tokens == 2
    server.wait_for(lambda s: s['slora_pool_pages{owner="kv"}'] == 0 and s["slora_requests_inflight"] == 0,
                    what="idle")


def test_more_sequences_than_max_concurrent_is_400_not_a_wait(https):
    """acme may run 1 sequence at once: two prompts, or n=2, could never run, so they are refused, not queued."""
    for body in ({"prompt": [PROMPT, PROMPT]}, {"prompt": PROMPT, "n": 2, "temperature": 1}):
        response = https["acme"].post("/v1/completions", json={"model": BASE_MODEL, "max_tokens": 2, **body})
        assert response.status_code == 400, response.text
        assert_error_shape(response.json(), 400)
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and error["param"] == "n", error
        assert "2 sequences" in error["message"] and "at most 1 at once" in error["message"], error
        assert "Retry-After" not in response.headers
    assert https["acme"].post("/v1/completions", json={"model": BASE_MODEL, "prompt": PROMPT, "max_tokens": 2}
                              ).status_code == 200


def test_single_user_mode_refuses_non_loopback_without_flag():
    result = subprocess.run([sys.executable, "-m", "slora.cli", "serve", "--host", "0.0.0.0", "--port",
                             str(free_port())], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "--allow-unauthenticated" in result.stderr


def test_adapter_quota_per_tenant(https, clients, offline):
    initech, ops = https["initech"], https["ops"]
    for name, path in (("one", "attn-r4"), ("two", "mlp-r8")):
        assert initech.post("/v1/adapters", json={"name": name, "path": path}).status_code == 200
    refused = initech.post("/v1/adapters", json={"name": "three", "path": "all-r16"})
    assert refused.status_code == 403, refused.text
    assert_error_shape(refused.json(), 403)
    assert refused.json()["error"]["code"] == "adapter_quota_exceeded" and "at most 2" in refused.json()["error"]["message"]
    # An admin loading into the tenant's namespace is held to the same quota.
    assert ops.post("/v1/adapters", json={"name": "three", "path": "all-r16", "owner": "initech"}).status_code == 403
    assert names(initech) >= {"one", "two"} and "three" not in names(initech)
    # Replacing a held name is not a new one, and an unload frees a place; serving never stopped.
    assert initech.post("/v1/adapters", json={"name": "two", "path": "all-r16"}).status_code == 200
    assert tokens_of(clients["initech"], "two") == greedy(offline, [PROMPT], "all-r16", 4)[0].token_ids
    assert initech.delete("/v1/adapters/one").status_code == 200
    assert initech.post("/v1/adapters", json={"name": "three", "path": "mlp-r8"}).status_code == 200
    # Other tenants are not limited by it.
    assert https["globex"].post("/v1/adapters", json={"name": "g-extra", "path": "attn-r4"}).status_code == 200


def test_token_rate_limit_per_tenant(https):
    hooli = https["hooli"]
    body = {"model": BASE_MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 20, "temperature": 0}
    assert hooli.post("/v1/completions", json=body).status_code == 200            # 25 of 60 tokens
    assert hooli.post("/v1/completions", json=body).status_code == 200            # 50 of 60
    limited = hooli.post("/v1/completions", json=body)                              # 25 more do not fit
    assert limited.status_code == 429, limited.text
    assert_error_shape(limited.json(), 429)
    assert "60 tokens per minute" in limited.json()["error"]["message"]
    assert 1 <= int(limited.headers["Retry-After"]) <= 60
    too_large = hooli.post("/v1/completions", json={**body, "max_tokens": 30, "n": 2})   # 65 > 60: never fits
    assert too_large.status_code == 400 and "Request too large" in too_large.json()["error"]["message"]
    assert "Retry-After" not in too_large.headers                                  # retrying cannot help
    # Other tenants are not limited by it.
    assert https["globex"].post("/v1/completions", json=body).status_code == 200


def test_token_rate_charges_what_ran(https):
    """A request refused before it ran costs nothing; one that ran costs its prompt and completion tokens,
    not its whole max_tokens reservation."""
    umbrella = https["umbrella"]
    body = {"model": BASE_MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 50, "temperature": 0}
    for _ in range(3):                      # 55 reserved each time, refunded each time: the adapter is unknown
        assert umbrella.post("/v1/completions", json={**body, "model": "no-such-adapter"}).status_code == 404
    short = umbrella.post("/v1/completions", json={**body, "stop_token_ids": list(range(512))})   # stops at once
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 1
    # 5 + 1 of its 55 reserved tokens were used, so 54 of the 60 are there: a 50-token request fits (with the
    # whole reservation kept, about 5 would be, plus the refill of 1 per second).
    assert umbrella.post("/v1/completions", json={**body, "max_tokens": 45}).status_code == 200
