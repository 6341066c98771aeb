"""Adapters managed through the API while the server serves: hot load, unload while streaming, new
versions under a name, uploads, the vLLM routes, and every refusal (paths, pickles, invalid adapters)."""
import importlib.util
import shutil
import threading
from pathlib import Path

import openai
import pytest
from conftest import BASE_MODEL, assert_error_shape, copy_adapter, greedy, start_server

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(shared_server, adapter_root):
    """The session's server of these arguments, test_openai_compat.py's too: no test here depends on a fresh
    one (pool pages and adapters are compared before and after, by name). It must exit 0 (shared_server)."""
    return shared_server(start_server, "--adapter-root", str(adapter_root))


def adapters_by_name(http) -> dict[str, dict]:
    response = http.get("/v1/adapters")
    assert response.status_code == 200, response.text
    return {a["name"]: a for a in response.json()["data"]}


def tokens_of(client, model: str, max_tokens: int, **kwargs) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                    extra_body={"return_token_ids": True, **kwargs})
    return out.choices[0].token_ids


def start_streams(server, jobs: list[tuple[str, int]]) -> tuple[list[threading.Thread], dict, list, threading.Event]:
    """Threads that each stream one (model, max_tokens) completion; `started` is set at the first chunk."""
    results, errors, started = {}, [], threading.Event()

    def run(i: int, model: str, max_tokens: int) -> None:
        try:
            with server.client() as c:
                tokens, reason = [], None
                for chunk in c.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True,
                                                                           "ignore_eos": True}):
                    started.set()
                    for choice in chunk.choices:
                        tokens += choice.token_ids or []
                        reason = choice.finish_reason or reason
                results[i] = (tokens, reason)
        except Exception as exc:  # reported by the main thread
            errors.append((i, repr(exc)))
            started.set()

    threads = [threading.Thread(target=run, args=(i, m, n)) for i, (m, n) in enumerate(jobs)]
    for t in threads:
        t.start()
    return threads, results, errors, started


def test_hot_load_while_16_streams_run(server, client, http, offline):
    models = [BASE_MODEL, "demo-r4-attn", "demo-r8-mlp", "demo-r16-all"]
    jobs = [(models[i % 4], 12) for i in range(16)]
    expected = {m: greedy(offline, [PROMPT], None if m == BASE_MODEL else m, 12, ignore_eos=True)[0].token_ids
                for m in models}
    threads, results, errors, started = start_streams(server, jobs)
    assert started.wait(60)
    response = http.post("/v1/adapters", json={"name": "hot", "path": "mlp-r8"})
    assert response.status_code == 200, response.text
    assert len(results) < 16                  # it loaded while streams were still running
    loaded = response.json()
    assert loaded["rank"] == 8 and loaded["pages"] > 0 and loaded["residency"] in ("host", "pool")
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == 16
    for i, (tokens, reason) in results.items():
        assert tokens == expected[jobs[i][0]] and reason == "length", i
    assert tokens_of(client, "hot", 6) == greedy(offline, [PROMPT], "mlp-r8", 6)[0].token_ids


def test_unload_while_streaming_finishes_then_404_then_pages_free(server, client, http, offline):
    assert http.post("/v1/adapters", json={"name": "going", "path": "all-r16"}).status_code == 200
    pages = adapters_by_name(http)["going"]["pages"]
    expected = greedy(offline, [PROMPT], "all-r16", 24, ignore_eos=True)[0].token_ids
    threads, results, errors, started = start_streams(server, [("going", 24)])
    assert started.wait(60)
    before = server.metrics()['slora_pool_pages{owner="adapter"}']
    response = http.delete("/v1/adapters/going")
    assert response.status_code == 200, response.text
    with pytest.raises(openai.NotFoundError):                      # new requests: 404 at once
        client.completions.create(model="going", prompt=PROMPT, max_tokens=2)
    threads[0].join(timeout=120)
    assert not errors, errors
    assert results[0] == (expected, "length")                       # the in-flight one finished on it
    after = server.wait_for(lambda s: s['slora_pool_pages{owner="kv"}'] == 0, what="idle")
    assert after['slora_pool_pages{owner="adapter"}'] == before - pages
    kv_pages = sum(after[f'slora_pool_pages{{owner="{owner}"}}'] for owner in ("free", "kv", "cached"))
    assert after["slora_kv_token_capacity"] == 16 * kv_pages          # the pages adapters do not hold, in tokens
    assert "going" not in adapters_by_name(http)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="going", prompt=PROMPT, max_tokens=2)


def test_new_version_under_a_name_keeps_in_flight_requests_on_the_old(server, client, http, offline):
    assert http.post("/v1/adapters", json={"name": "swap", "path": "attn-r4"}).status_code == 200
    old = adapters_by_name(http)["swap"]["version"]
    expected_old = greedy(offline, [PROMPT], "attn-r4", 20, ignore_eos=True)[0].token_ids
    threads, results, errors, started = start_streams(server, [("swap", 20)])
    assert started.wait(60)
    assert http.post("/v1/adapters", json={"name": "swap", "path": "mlp-r8"}).status_code == 200
    assert adapters_by_name(http)["swap"]["version"] != old
    assert tokens_of(client, "swap", 5) == greedy(offline, [PROMPT], "mlp-r8", 5)[0].token_ids
    threads[0].join(timeout=120)
    assert not errors, errors
    assert results[0] == (expected_old, "length")


def test_vllm_compatible_routes(http, client, offline):
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "vllm-style", "lora_path": "attn-r4"})
    assert response.status_code == 200 and "Success" in response.text
    assert tokens_of(client, "vllm-style", 4) == greedy(offline, [PROMPT], "attn-r4", 4)[0].token_ids
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "vllm-style"})
    assert response.status_code == 200 and "Success" in response.text
    missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "vllm-style"})
    assert missing.status_code == 404
    assert_error_shape(missing.json(), 404)


def test_upload_of_the_two_peft_files(http, client, offline, adapter_root):
    folder = adapter_root / "all-r16"
    files = {"adapter_config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
             "adapter_model": ("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes())}
    response = http.post("/v1/adapters", data={"name": "uploaded"}, files=files)
    assert response.status_code == 200, response.text
    assert response.json()["rank"] == 16
    assert tokens_of(client, "uploaded", 4) == greedy(offline, [PROMPT], "all-r16", 4)[0].token_ids


def test_upload_of_a_pickle_is_refused(http, adapter_root):
    folder = adapter_root / "attn-r4"
    files = {"adapter_config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
             "adapter_model": ("adapter_model.bin", b"\x80\x04\x95 not really a pickle")}
    response = http.post("/v1/adapters", data={"name": "pickled"}, files=files)
    assert response.status_code == 400
    assert_error_shape(response.json(), 400)
    assert "pickle" in response.json()["error"]["message"]
    assert "pickled" not in adapters_by_name(http)


def _escape_paths(adapter_root: Path, tmp_path: Path) -> list[str]:
    outside = tmp_path / "outside-adapter"
    shutil.copytree(adapter_root / "attn-r4", outside)
    link = adapter_root / "link-out"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    file_link = adapter_root / "file-link-out"
    if not file_link.exists():
        file_link.mkdir()
        shutil.copy(outside / "adapter_config.json", file_link / "adapter_config.json")
        (file_link / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    return ["../outside-adapter", "attn-r4/../../outside-adapter", str(outside), "/etc", "link-out",
            "file-link-out", "", "."]


def test_paths_outside_the_adapter_root_are_refused(http, client, adapter_root, tmp_path):
    for path in _escape_paths(adapter_root, tmp_path):
        for route, body in (("/v1/adapters", {"name": "escape", "path": path}),
                            ("/v1/load_lora_adapter", {"lora_name": "escape", "lora_path": path})):
            response = http.post(route, json=body)
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["type"] == "invalid_request_error"
    assert "escape" not in adapters_by_name(http)
    assert client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=2).choices[0].finish_reason


def _engine_validation_cases() -> dict:
    """The engine's own table of invalid adapters (tests/adapters/test_validation.py), so that every case it
    knows is also refused through the API."""
    path = Path(__file__).parents[1] / "adapters" / "test_validation.py"
    spec = importlib.util.spec_from_file_location("engine_validation_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


def test_every_invalid_adapter_case_is_a_400_and_the_server_keeps_serving(server, http, client, adapter_root):
    cases = _engine_validation_cases()
    assert len(cases) >= 10
    before = server.metrics()['slora_pool_pages{owner="free"}']
    for case, (breaker, words) in sorted(cases.items()):
        folder = copy_adapter(adapter_root, "attn-r4", f"invalid-{case}")
        breaker(folder)
        response = http.post("/v1/adapters", json={"name": f"bad-{case}", "path": f"invalid-{case}"})
        assert response.status_code == 400, (case, response.text)
        body = response.json()
        assert_error_shape(body, 400)
        assert words in body["error"]["message"], (case, body)
        assert str(adapter_root) not in body["error"]["message"]
    names = adapters_by_name(http)
    assert not [n for n in names if n.startswith("bad-")]
    assert server.metrics()['slora_pool_pages{owner="free"}'] == before
    assert http.get("/health").status_code == 200
    assert client.completions.create(model="demo-r4-attn", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_adapter_listing_fields(http):
    listed = adapters_by_name(http)
    demo = listed["demo-r16-all"]
    assert {"name", "version", "rank", "target_modules", "pages", "residency", "owner", "public"} <= set(demo)
    assert demo["rank"] == 16 and len(demo["target_modules"]) == 7 and demo["public"] is True
    assert demo["residency"] in ("host", "pool")


def test_adapter_name_rules(http):
    for body in ({"name": BASE_MODEL, "path": "attn-r4"}, {"name": "has space", "path": "attn-r4"},
                 {"name": "x", "path": "attn-r4", "unknown": 1}):
        response = http.post("/v1/adapters", json=body)
        assert response.status_code == 400, body
        assert_error_shape(response.json(), 400)
    assert http.delete("/v1/adapters/never-loaded").status_code == 404


def _peft_files(adapter_root: Path, source: str) -> tuple[bytes, bytes]:
    folder = adapter_root / source
    return (folder / "adapter_config.json").read_bytes(), (folder / "adapter_model.safetensors").read_bytes()


def test_upload_with_its_two_files_swapped_is_refused_naming_the_fields(http, adapter_root):
    config, weights = _peft_files(adapter_root, "attn-r4")
    crossed = {  # each form as a client with crossed variables sends it
        "contents": {"adapter_config": ("adapter_config.json", weights),
                     "adapter_model": ("adapter_model.safetensors", config)},
        "fields": {"adapter_config": ("adapter_model.safetensors", weights),
                   "adapter_model": ("adapter_config.json", config)},
        "full names": {"adapter_config.json": ("adapter_config.json", weights),
                       "adapter_model.safetensors": ("adapter_model.safetensors", config)},
    }
    for case, files in crossed.items():
        response = http.post("/v1/adapters", data={"name": "swapped"}, files=files)
        assert response.status_code == 400, (case, response.text)
        error = response.json()["error"]
        assert_error_shape(response.json(), 400)
        assert error["code"] == "upload_files_swapped" and error["param"] == "files", (case, error)
        assert "swapped" in error["message"], (case, error)
        for field in files:
            assert f"field '{field}'" in error["message"], (case, error)
    by_file_name = {"files": ("adapter_config.json", weights), "more": ("adapter_model.safetensors", config)}
    response = http.post("/v1/adapters", data={"name": "swapped"}, files=by_file_name)
    assert response.status_code == 400 and response.json()["error"]["code"] == "upload_files_swapped"
    assert "file 'adapter_config.json'" in response.json()["error"]["message"]
    assert "swapped" not in adapters_by_name(http)


def test_upload_by_field_names_whatever_the_file_names(http, adapter_root):
    config, weights = _peft_files(adapter_root, "attn-r4")
    files = {"adapter_config": ("model.safetensors", config), "adapter_model": ("config.json", weights)}
    response = http.post("/v1/adapters", data={"name": "renamed-files"}, files=files)
    assert response.status_code == 200, response.text
    assert http.delete("/v1/adapters/renamed-files").status_code == 200


def test_model_cards_name_who_owns_each_adapter(http, adapter_root):
    config, weights = _peft_files(adapter_root, "mlp-r8")
    files = {"adapter_config": ("adapter_config.json", config), "adapter_model": ("adapter_model.safetensors", weights)}
    assert http.post("/v1/adapters", data={"name": "mine-uploaded"}, files=files).status_code == 200
    assert http.post("/v1/adapters", json={"name": "mine-by-path", "path": "attn-r4"}).status_code == 200
    try:
        owners = {card["id"]: card["owned_by"] for card in http.get("/v1/models").json()["data"]}
        # The model's built-in demo adapters are the server's; the single user's own loads are its (`local`).
        assert {owners[name] for name in (BASE_MODEL, "demo-r4-attn", "demo-r8-mlp", "demo-r16-all")} == {"slora"}
        assert owners["mine-uploaded"] == owners["mine-by-path"] == "local"
        assert http.get("/v1/models/demo-r4-attn").json()["owned_by"] == "slora"
        assert http.get("/v1/models/mine-uploaded").json()["owned_by"] == "local"
    finally:
        for name in ("mine-uploaded", "mine-by-path"):
            assert http.delete(f"/v1/adapters/{name}").status_code == 200
