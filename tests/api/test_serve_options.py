"""`slora serve` options from vLLM: --lora-modules (loaded at start, public), --enable-lora-resolver (an unloaded
adapter named by a request is loaded from the adapter root, into the caller's namespace) and --served-model-name.
One server with tenants serves every test here; the refused starts run their own short-lived processes."""
import json
import re
import shutil
import subprocess
import sys
import threading

import pytest
from conftest import BASE_MODEL, assert_error_shape, free_port, greedy, start_server, write_tenants

from slora.api.settings import LoraModule, ServerSettings, parse_lora_module
from slora.cli import main

KEYS = {"acme": "acme-key", "globex": "globex-key", "ops": "ops-key"}
SERVED = ["tiny-base", "tiny-alias"]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def root(tmp_path_factory, adapter_root):
    """This module's adapter root: copies of two test adapters, a broken one, a symbolic link out of it."""
    folder = tmp_path_factory.mktemp("resolver-root")
    for name in ("attn-r4", "mlp-r8"):
        shutil.copytree(adapter_root / name, folder / name)
    for name in ("resolved", "concurrent", "quota-one", "quota-two", "vanishing"):
        shutil.copytree(adapter_root / "attn-r4", folder / name)
    shutil.copytree(adapter_root / "attn-r4", folder / "broken")
    config = json.loads((folder / "broken" / "adapter_config.json").read_text())
    (folder / "broken" / "adapter_config.json").write_text(json.dumps({**config, "r": 999}))
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(adapter_root / "attn-r4", outside / "attn-r4")
    (folder / "escape").symlink_to(outside / "attn-r4", target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, root):
    folder = tmp_path_factory.mktemp("serve-options")
    tenants = write_tenants(folder, {"acme": {"key": KEYS["acme"]},
                                     "globex": {"key": KEYS["globex"], "max_adapters": 1},
                                     "ops": {"key": KEYS["ops"], "role": "admin"}})
    module_json = json.dumps({"name": "mod-json", "path": str(root / "mlp-r8"), "base_model_name": BASE_MODEL})
    srv = start_server(folder, "--tenants", str(tenants), "--adapter-root", str(root), "--enable-lora-resolver",
                       "--lora-modules", "mod-kv=attn-r4", module_json, "--served-model-name", *SERVED)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def tokens(server, key: str, model: str, max_tokens: int = 6) -> list[int]:
    with server.client(KEYS[key]) as client:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                        extra_body={"return_token_ids": True})
    return out.choices[0].token_ids


def post(server, key: str, model: str):
    with server.http(KEYS[key]) as http:
        return http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})


def registrations(server) -> float:
    return server.metrics().get("slora_adapter_registrations_total", 0.0)


def names(server, key: str, route: str) -> dict[str, dict]:
    with server.http(KEYS[key]) as http:
        response = http.get(route)
    assert response.status_code == 200, response.text
    return {entry.get("id", entry.get("name")): entry for entry in response.json()["data"]}


# ---- --lora-modules ------------------------------------------------------------------------------------------
def test_lora_modules_of_both_forms_serve_every_tenant_as_the_offline_llm_does(server, offline):
    expected_kv = greedy(offline, [PROMPT], "attn-r4", 6)[0].token_ids
    expected_json = greedy(offline, [PROMPT], "mlp-r8", 6)[0].token_ids
    for key in ("acme", "globex"):
        assert tokens(server, key, "mod-kv") == expected_kv
        assert tokens(server, key, "mod-json") == expected_json
        adapters = names(server, key, "/v1/adapters")
        assert adapters["mod-kv"]["public"] and adapters["mod-kv"]["owner"] is None       # no tenant's
    assert names(server, "ops", "/v1/adapters")["mod-json"]["owner"] is None


def test_lora_modules_are_not_any_tenants_to_unload(server):
    with server.http(KEYS["acme"]) as http:
        assert http.delete("/v1/adapters/mod-kv").status_code == 404
    assert "mod-kv" in names(server, "acme", "/v1/models")


def test_parse_lora_module_forms_and_refusals(tmp_path, adapter_root):
    assert parse_lora_module("a=some/path=x") == LoraModule("a", "some/path=x")
    assert parse_lora_module('{"name": "b", "path": "/p", "base_model_name": "m"}') == LoraModule("b", "/p", "m")
    for bad, words in (("no-equals", "name=path"), ("a=", "name=path"), ('{"name": "b"}', '"path"'),
                       ('{"name": "b", "path": "/p", "rank": 4}', "unknown key(s) rank"), ("{oops", "not valid JSON")):
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_lora_module(bad)
    for modules, words in (((LoraModule("../x", "attn-r4"),), "'../x': an adapter name"),
                           ((LoraModule("a", "attn-r4"), LoraModule("a", "mlp-r8")), "'a': the name is given twice"),
                           ((LoraModule("a", "../attn-r4"),), "'a': adapter path must not contain '..'"),
                           ((LoraModule("a", str(tmp_path)),), "'a': adapter path must name a folder inside")):
        with pytest.raises(ValueError, match=re.escape(words)):
            ServerSettings(adapter_root=str(adapter_root), lora_modules=modules)
    with pytest.raises(ValueError, match="'b': .* is not a folder"):
        ServerSettings(lora_modules=(LoraModule("b", str(tmp_path / "missing")),))
    with pytest.raises(ValueError, match="needs an adapter root"):
        ServerSettings(enable_lora_resolver=True)


def test_a_bad_lora_module_stops_the_start_with_one_line_naming_it(root, capsys):
    # Its name and path are checked before the model loads (in-process: main() returns before serving) ...
    assert main(["serve", "--model", BASE_MODEL, "--port", str(free_port()), "--adapter-root", str(root),
                 "--lora-modules", "good=attn-r4", "bad=../attn-r4"]) == 2
    assert capsys.readouterr().err == "slora: error: --lora-modules 'bad': adapter path must not contain '..'\n"
    # ... its files once the engine is up, as the admin route checks them; then the server stops.
    late = subprocess.run([sys.executable, "-m", "slora.cli", "serve", "--model", BASE_MODEL, "--port",
                           str(free_port()), "--adapter-root", str(root), "--lora-modules", "good=attn-r4",
                           "worse=broken"], capture_output=True, text=True, timeout=300, check=False)
    assert late.returncode != 0
    last = late.stderr.strip().splitlines()[-1]
    assert last.startswith("slora: error: --lora-modules 'worse': ") and "rank 999" in last, late.stderr[-2000:]
    assert "Traceback" not in late.stderr, late.stderr[-3000:]


# ---- --served-model-name -------------------------------------------------------------------------------------
def test_served_model_names_replace_the_models_own(server):
    models = names(server, "acme", "/v1/models")
    assert next(iter(models)) == SERVED[0] and BASE_MODEL not in models and SERVED[1] not in models
    assert models["mod-kv"]["parent"] == SERVED[0]
    with server.client(KEYS["acme"]) as client:
        for name in SERVED:
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
            assert out.model == SERVED[0] and out.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model=SERVED[1], messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
        assert chat.model == SERVED[0]
    response = post(server, "acme", BASE_MODEL)
    assert response.status_code == 404, response.text
    assert_error_shape(response.json(), 404)
    with server.http(KEYS["acme"]) as http:       # nor may an adapter take one of the base model's names
        refused = http.post("/v1/adapters", json={"name": SERVED[1], "path": "attn-r4"})
    assert refused.status_code == 400 and "base model" in refused.json()["error"]["message"]


# ---- --enable-lora-resolver ----------------------------------------------------------------------------------
def test_resolver_loads_on_first_use_then_reuses(server, offline):
    before = registrations(server)
    expected = greedy(offline, [PROMPT], "attn-r4", 6)[0].token_ids
    assert tokens(server, "acme", "resolved") == expected
    assert registrations(server) == before + 1
    assert tokens(server, "acme", "resolved") == expected
    assert registrations(server) == before + 1
    assert names(server, "acme", "/v1/adapters")["resolved"]["owner"] == "acme"


def test_resolver_refuses_what_is_not_a_folder_inside_the_root(server):
    before = registrations(server)
    for model in ("../attn-r4", "escape", "no-such-adapter", "attn-r4/..", ".."):
        response = post(server, "acme", model)
        assert response.status_code == 404, (model, response.text)
        assert response.json()["error"]["code"] == "model_not_found"
    assert registrations(server) == before
    assert not {"escape", "broken"} & set(names(server, "ops", "/v1/adapters"))


def test_resolver_answers_a_tenant_one_404_and_tells_the_reason_to_admins_and_the_log(server):
    """A tenant cannot tell a folder with invalid files from no folder at all: the root's contents stay unknown to
    it. An admin gets the reason, and so does the log."""
    missing, broken = post(server, "acme", "no-such-adapter"), post(server, "acme", "broken")
    assert missing.status_code == broken.status_code == 404, broken.text
    assert broken.json()["error"]["code"] == missing.json()["error"]["code"] == "model_not_found"
    assert broken.json()["error"]["message"] == missing.json()["error"]["message"].replace("no-such-adapter", "broken")
    assert "999" not in broken.text
    as_admin = post(server, "ops", "broken")
    assert as_admin.status_code == 400 and as_admin.json()["error"]["param"] == "model", as_admin.text
    assert "999" in as_admin.json()["error"]["message"]
    assert_error_shape(as_admin.json(), 400)
    assert "resolver: adapter broken not loaded for acme" in server.log()
    assert "broken" not in names(server, "ops", "/v1/adapters")


def test_resolved_adapters_are_the_tenants_own(server, root):
    assert tokens(server, "acme", "vanishing")
    assert names(server, "acme", "/v1/adapters")["vanishing"]["owner"] == "acme"
    assert "vanishing" not in names(server, "globex", "/v1/adapters")
    assert "vanishing" not in names(server, "globex", "/v1/models")
    with server.http(KEYS["globex"]) as http:
        assert http.delete("/v1/adapters/vanishing").status_code == 404
    shutil.rmtree(root / "vanishing")          # globex would get a copy of its own: now there is none to load
    assert post(server, "globex", "vanishing").status_code == 404
    assert post(server, "acme", "vanishing").status_code == 200      # acme's is loaded, files or not


def test_resolver_keeps_the_tenants_adapter_quota(server):
    assert post(server, "globex", "quota-one").status_code == 200
    refused = post(server, "globex", "quota-two")
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", refused.text
    assert "max_adapters" not in refused.text
    assert "quota-two" not in names(server, "globex", "/v1/adapters")
    assert "resolver: adapter quota-two not loaded for globex" in server.log()


def test_concurrent_first_requests_load_the_adapter_once(server, offline):
    before = registrations(server)
    results, errors, barrier = [], [], threading.Barrier(8)

    def run() -> None:
        try:
            barrier.wait()
            results.append(tokens(server, "acme", "concurrent", 4))
        except Exception as exc:  # reported below
            errors.append(repr(exc))
    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert results == [greedy(offline, [PROMPT], "attn-r4", 4)[0].token_ids] * 8
    assert registrations(server) == before + 1
    assert server.log().count("resolver: loading adapter concurrent ") == 1


def test_tokenizer_routes_need_a_key_with_tenants(server):
    with server.http() as http:
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
                             ("GET", "/version")):
            response = http.request(method, path, json={"prompt": "hi"} if method == "POST" else None)
            assert response.status_code == 401, (path, response.text)
    with server.http(KEYS["acme"]) as http:
        assert http.post("/tokenize", json={"model": "mod-kv", "prompt": "hi"}).status_code == 200
        assert http.post("/tokenize", json={"model": "no-such-adapter", "prompt": "hi"}).status_code == 404
        assert http.post("/tokenize", json={"model": "tiny-alias", "prompt": "hi"}).status_code == 200
