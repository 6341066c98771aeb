"""The adapter store: adapters loaded through the API survive a restart (SIGTERM or SIGKILL) with their names,
owners, versions and load times; unloads leave it; orphaned uploads go at start. And what one tenant may learn
of another's adapters: residency only of versions it used itself."""
import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from conftest import adapter_files, greedy, start_server, write_tenants

KEYS = {"ops": "store-admin-key", "acme": "store-acme-key", "zeta": "store-zeta-key"}
PROMPT = "The quick brown fox"
STORED = {"acme-up", "zeta-path", "pub", "pub-up"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, adapter_root):
    folder = tmp_path_factory.mktemp("adapter-store")
    tenants = write_tenants(folder, {"ops": {"key": KEYS["ops"], "role": "admin"},
                                     "acme": {"key": KEYS["acme"]}, "zeta": {"key": KEYS["zeta"]}})
    return folder, folder / "store", ("--tenants", str(tenants), "--adapter-root", str(adapter_root),
                                      "--adapter-store", str(folder / "store"))


def start(setup):
    folder, _, args = setup
    return start_server(folder, *args)


def call(server, key: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {KEYS[key]}"},
                         timeout=120, **kwargs)


def tokens(server, key: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    response = call(server, key, "POST", "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def listing(server, key: str) -> dict[str, dict]:
    return {a["name"]: a for a in call(server, key, "GET", "/v1/adapters").json()["data"]}


def load_all(server, adapter_root: Path) -> None:
    """An upload of acme, a path load of zeta, a public path load of the admin, a public upload of the admin."""
    upload = call(server, "acme", "POST", "/v1/adapters", data={"name": "acme-up"},
                  files=adapter_files(adapter_root, "mlp-r8"))
    assert upload.status_code == 200, upload.text
    by_path = call(server, "zeta", "POST", "/v1/adapters", json={"name": "zeta-path", "path": "attn-r4"})
    assert by_path.status_code == 200, by_path.text
    public = call(server, "ops", "POST", "/v1/adapters", json={"name": "pub", "path": "all-r16", "public": True})
    assert public.status_code == 200, public.text
    shared = call(server, "ops", "POST", "/v1/adapters", data={"name": "pub-up", "public": "true"},
                  files=adapter_files(adapter_root, "attn-r4"))
    assert shared.status_code == 200, shared.text


def snapshot(server) -> dict:
    """What each tenant sees and gets: its listing of the adapters loaded through the API (name, owner, version,
    loaded_at; the model's built-in ones are loaded anew at each start) and its greedy tokens."""
    seen = {}
    for key, models in (("acme", ["acme-up", "pub", "pub-up"]), ("zeta", ["zeta-path", "pub"])):
        listed = {name: a for name, a in listing(server, key).items() if name in STORED}
        seen[key] = {"listing": {name: (a["owner"], a["version"], a["loaded_at"]) for name, a in listed.items()},
                     "tokens": {model: tokens(server, key, model) for model in models}}
    return seen


def upload_folders(store: Path) -> set[str]:
    return {p.relative_to(store).as_posix() for p in store.glob("uploads/*/*")}


def test_adapters_survive_sigterm_then_sigkill_and_orphans_go(setup, adapter_root, offline):
    _, store, _ = setup
    server = start(setup)
    try:
        load_all(server, adapter_root)
        before = snapshot(server)
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert before["acme"]["tokens"]["acme-up"] == greedy(offline, [PROMPT], "mlp-r8", 8)[0].token_ids
    assert set(before["acme"]["listing"]) == {"acme-up", "pub", "pub-up"}          # not zeta's
    assert set(before["zeta"]["listing"]) == {"zeta-path", "pub", "pub-up"}
    registry = json.loads((store / "registry.json").read_text())["adapters"]
    assert {(e["owner"], e["name"]) for e in registry} == {("acme", "acme-up"), ("zeta", "zeta-path"),
                                                            ("ops", "pub"), ("ops", "pub-up")}
    assert next(e for e in registry if e["name"] == "zeta-path")["path"] == "attn-r4"      # recorded, not copied

    server = start(setup)                        # after SIGTERM: everything answers as before
    try:
        assert snapshot(server) == before
        # A crash mid-upload leaves a folder no entry names, and a temporary registry file.
        orphan = store / "uploads" / "acme" / "half-written-0123456789ab"
        orphan.mkdir()
        (orphan / "adapter_config.json").write_text("{")
        (store / ".registry.json.tmp-crash").write_text("{")
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=60)
    finally:
        server.stop()

    server = start(setup)                        # after SIGKILL: the same, and nothing orphaned is left
    try:
        assert snapshot(server) == before
        assert not orphan.exists() and not list(store.glob(".registry.json.tmp-*"))
        assert len(upload_folders(store)) == 2
        assert "orphaned folder(s) or file(s): " in server.log()
        assert call(server, "acme", "DELETE", "/v1/adapters/acme-up").status_code == 200
    finally:
        assert server.stop() == 0, server.log()[-3000:]

    server = start(setup)                        # an unload leaves the store, files and all
    try:
        assert "acme-up" not in listing(server, "acme")
        assert call(server, "acme", "POST", "/v1/completions",
                    json={"model": "acme-up", "prompt": PROMPT, "max_tokens": 2}).status_code == 404
        assert not any(folder.startswith("uploads/acme/") for folder in upload_folders(store))
        assert tokens(server, "zeta", "zeta-path") == before["zeta"]["tokens"]["zeta-path"]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert "Traceback" not in server.log()


def test_a_store_another_server_holds_is_a_clear_error(setup, tmp_path):
    server = start(setup)
    try:
        with pytest.raises(RuntimeError, match="in use by another slora server"):
            start_server(tmp_path, *setup[2])
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_a_tenant_sees_residency_only_of_versions_it_used(setup, adapter_root):
    """Residency would tell one tenant what another runs (the same public adapter, or the same weights uploaded
    twice): a tenant sees the residency of a fresh load until it has used the version itself."""
    server = start(setup)
    try:
        assert call(server, "ops", "POST", "/v1/adapters",
                    json={"name": "watched", "path": "mlp-r8", "public": True}).status_code == 200
        tokens(server, "acme", "watched")                       # acme's use brings it into the pool
        assert listing(server, "ops")["watched"]["residency"] == "pool"
        assert listing(server, "acme")["watched"]["residency"] == "pool"
        assert listing(server, "zeta")["watched"]["residency"] == "host"     # what zeta would see unused
        tokens(server, "zeta", "watched")
        assert listing(server, "zeta")["watched"]["residency"] == "pool"

        upload = call(server, "acme", "POST", "/v1/adapters", data={"name": "twin"},
                      files=adapter_files(adapter_root, "all-r16"))
        assert upload.status_code == 200, upload.text
        tokens(server, "acme", "twin")
        same = call(server, "zeta", "POST", "/v1/adapters", data={"name": "twin"},
                    files=adapter_files(adapter_root, "all-r16"))
        assert same.status_code == 200 and same.json()["version"] == upload.json()["version"]
        assert same.json()["residency"] == "host" and listing(server, "zeta")["twin"]["residency"] == "host"
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_concurrent_loads_and_unloads_keep_the_registry_equal_to_the_names(setup, adapter_root):
    server = start(setup)
    errors: list[str] = []

    def churn(index: int) -> None:
        for round_ in range(3):
            name = f"churn-{index}"
            response = call(server, "acme", "POST", "/v1/adapters", json={"name": name, "path": "attn-r4"})
            if response.status_code != 200:
                errors.append(response.text)
            if round_ < 2 and call(server, "acme", "DELETE", f"/v1/adapters/{name}").status_code != 200:
                errors.append(f"delete {name}")
    try:
        threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not errors, errors
        listed = {name for name in listing(server, "acme") if name.startswith("churn-")}
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    _, store, _ = setup
    registry = json.loads((store / "registry.json").read_text())["adapters"]
    assert {e["name"] for e in registry if e["name"].startswith("churn-")} == listed == {f"churn-{i}" for i in range(4)}


# ---- the registry file ----------------------------------------------------------------------------------------
def test_a_registry_that_is_not_json_stops_the_start_and_deletes_nothing(tmp_path):
    """Taken for empty, it would make every upload an orphan to delete."""
    from slora.api.adapter_store import AdapterStore, StoreError
    upload = tmp_path / "uploads" / "acme" / "kept-0123456789ab"
    upload.mkdir(parents=True)
    (tmp_path / "registry.json").write_text('{"adapters": [')
    with pytest.raises(StoreError, match="not valid JSON"):
        AdapterStore(tmp_path).open()
    assert upload.is_dir()


def test_a_malformed_entry_is_left_out_and_the_others_are_kept(tmp_path):
    from slora.api.adapter_store import AdapterStore
    good = {"name": "kept", "owner": "acme", "public": False, "version": "v1", "loaded_at": "2026-12-06T00:00:00Z",
            "upload": "uploads/acme/kept-0123456789ab", "path": None}
    both = {**good, "name": "both", "path": "attn-r4"}                 # an upload and a path at once
    (tmp_path / "uploads" / "acme" / "kept-0123456789ab").mkdir(parents=True)
    (tmp_path / "registry.json").write_text(json.dumps({"format": 1, "adapters": [good, both, 7]}))
    store = AdapterStore(tmp_path)
    try:
        assert [entry.name for entry in store.open()] == ["kept"]
    finally:
        store.close()
