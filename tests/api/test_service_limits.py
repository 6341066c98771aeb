"""The HTTP service's own limits against a real server: body limits by content type, the key checked before
the body, uploaded folders deleted and per-tenant byte quotas, path errors, no slash redirect, connection
timeouts and cap, /metrics behind an admin key, a taken port, and a CLI flag for every ServerSettings limit.

Every request opens a connection of its own (httpx.request, or a raw socket for what clients cannot send),
so that no idle keep-alive connection of one test counts against the connection cap of another."""
import dataclasses
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import BASE_MODEL, adapter_files, assert_error_shape, start_server, wait_until, write_tenants
from prometheus_client.parser import text_string_to_metric_families

from slora.api.settings import ServerSettings
from slora.api.tenants import hash_key
from slora.cli import SERVE_LIMITS, build_parser, serve_settings

KEYS = {"ops": "ops-key-1", "acme": "acme-key-2", "tiny": "tiny-key-3"}
MAX_BODY = 65_536
MAX_UPLOAD = 1_500_000
ACME_QUOTA = 250_000          # attn-r4 (67,840 bytes) and mlp-r8 (156,882) fit; a third adapter does not
TINY_QUOTA = 1_000            # smaller than any adapter
SERVER_QUOTA = 5_000_000      # the default, for tenants without their own (ops)
HEADER_S, BODY_IDLE_S, KEEP_ALIVE_S = 2.0, 4.0, 2.0
MAX_CONNECTIONS = 6
SLACK_S = 30.0                # on top of a timeout, for a loaded machine
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapter-store")


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter_root, store):
    folder = tmp_path_factory.mktemp("limits")
    tenants = write_tenants(folder, {"ops": {"key": KEYS["ops"], "role": "admin"},
                                     "acme": {"key": KEYS["acme"], "max_adapter_bytes": ACME_QUOTA},
                                     "tiny": {"key": KEYS["tiny"], "max_adapter_bytes": TINY_QUOTA}})
    srv = start_server(folder, "--tenants", str(tenants), "--adapter-root", str(adapter_root), "--adapter-store",
                       str(store), "--metrics-require-key", "--max-body-bytes", str(MAX_BODY),
                       "--max-upload-bytes", str(MAX_UPLOAD), "--max-adapter-bytes", str(SERVER_QUOTA),
                       "--timeout-header", str(HEADER_S), "--timeout-body-idle", str(BODY_IDLE_S),
                       "--timeout-keep-alive", str(KEEP_ALIVE_S), "--max-connections", str(MAX_CONNECTIONS))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    # The uploads still loaded stay for the next start, each named by the store's registry; no other is left.
    registry = json.loads((store / "registry.json").read_text())["adapters"]
    on_disk = {folder.relative_to(store).as_posix() for folder in store.glob("uploads/*/*")}
    assert on_disk == {entry["upload"] for entry in registry if entry["upload"]} and on_disk


# ---- helpers ------------------------------------------------------------------------------------------------
def call(server, method: str, path: str, key: str | None = None, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})} if key else kwargs.pop("headers", {})
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=120, **kwargs)


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def raw_request(server, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send a request head (and perhaps part of its body) on a fresh connection and read the answer."""
    with socket.create_connection(address(server), timeout=60) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def head(method: str, path: str, key: str | None, content_type: str, length: int | None) -> str:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Type: {content_type}"]
    lines += [f"Authorization: Bearer {key}"] if key else []
    lines += [f"Content-Length: {length}"] if length is not None else []
    return "\n".join(lines) + "\n\n"


def closed_within(sock: socket.socket, limit_s: float, drip: bytes | None = None) -> float:
    """Seconds until the server closes `sock` (sending `drip` every 0.2 s meanwhile, if given)."""
    began = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - began < limit_s:
        try:
            if drip is not None:
                sock.sendall(drip)
            if sock.recv(65536) == b"":
                return time.monotonic() - began
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - began
    raise AssertionError(f"the server kept the connection open for {limit_s} s")


def upload(server, key: str, name: str, adapter_root: Path, source: str) -> httpx.Response:
    return call(server, "POST", "/v1/adapters", key, data={"name": name}, files=adapter_files(adapter_root, source))


def folders(store: Path, namespace: str) -> list[Path]:
    """The namespace's upload folders in the adapter store."""
    return sorted(store.glob(f"uploads/{namespace}/*"))


def temp_files_open(server) -> list[str]:
    """Deleted files the server process holds open: the spooled uploads (anonymous temporary files)."""
    fd_dir = Path(f"/proc/{server.process.pid}/fd")
    targets = []
    for fd in fd_dir.iterdir():
        try:
            targets.append(os.readlink(fd))
        except FileNotFoundError:          # closed meanwhile
            continue
    return [t for t in targets if t.endswith("(deleted)")]


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert_error_shape(response.json(), status)
    return response.json()["error"]


# ---- 1. body limits by content type --------------------------------------------------------------------------
def test_json_bodies_get_the_json_limit_on_every_route(server):
    declared = raw_request(server, head("POST", "/v1/adapters", KEYS["ops"], "application/json", 500_000))
    assert declared[0] == 413 and str(MAX_BODY) in declared[2].decode()      # refused before any body byte
    assert declared[1]["connection"] == "close"
    chunks = (b"x" * 16_384 for _ in range(12))                         # no Content-Length: counted as it comes
    streamed = call(server, "POST", "/v1/adapters", KEYS["ops"], content=chunks,
                    headers={"content-type": "application/json"})
    assert str(MAX_BODY) in error_of(streamed, 413)["message"]
    multipart_elsewhere = call(server, "POST", "/v1/completions", KEYS["ops"], data={"model": BASE_MODEL},
                               files={"f": ("f.bin", b"\0" * 100_000)})
    assert error_of(multipart_elsewhere, 413)["code"] == "request_too_large"
    too_big_upload = raw_request(server, head("POST", "/v1/adapters", KEYS["ops"],
                                              "multipart/form-data; boundary=x", MAX_UPLOAD + 1))
    assert too_big_upload[0] == 413 and str(MAX_UPLOAD) in too_big_upload[2].decode()
    assert call(server, "GET", "/health").status_code == 200


def test_an_upload_over_the_json_limit_is_streamed_and_leaves_no_temporary_file(server, adapter_root):
    assert upload(server, KEYS["ops"], "big-enough", adapter_root, "attn-r4").status_code == 200   # 67,840 B
    assert temp_files_open(server) == []
    # A multipart body without a length that passes the upload limit after the spool went to disk (1 MiB).
    parts = [b"--b\r\nContent-Disposition: form-data; name=\"adapter_model\"; filename=\"adapter_model"
             b".safetensors\"\r\n\r\n"] + [b"\0" * 65_536] * 40
    refused = call(server, "POST", "/v1/adapters", KEYS["ops"], content=iter(parts),
                   headers={"content-type": "multipart/form-data; boundary=b"})
    assert str(MAX_UPLOAD) in error_of(refused, 413)["message"]
    wait_until(lambda: temp_files_open(server) == [], "the spooled upload to be closed")
    assert call(server, "DELETE", "/v1/adapters/big-enough", KEYS["ops"]).status_code == 200


# ---- 4. the key before the body --------------------------------------------------------------------------------
def test_a_bad_key_is_refused_before_the_body_is_read(server):
    for key in (None, "wrong-key"):
        status, headers, body = raw_request(server, head("POST", "/v1/completions", key, "application/json",
                                                         1_000))                  # the body never comes
        assert status == 401 and b"invalid_api_key" in body
        assert headers["connection"] == "close"
    # Even a body over the limit: who asks is answered first.
    assert raw_request(server, head("POST", "/v1/completions", None, "application/json", 10 ** 9))[0] == 401
    good = call(server, "POST", "/v1/completions", KEYS["acme"], json={"model": BASE_MODEL, "prompt": PROMPT,
                                                                         "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
    assert call(server, "GET", "/health").status_code == 200


# ---- 2. uploaded folders are deleted; per-tenant byte quotas ---------------------------------------------------
def test_uploaded_folders_are_deleted_on_delete_and_replace(server, adapter_root, store):
    assert upload(server, KEYS["ops"], "kept", adapter_root, "mlp-r8").status_code == 200
    [first] = folders(store, "ops")
    assert upload(server, KEYS["ops"], "kept", adapter_root, "all-r16").status_code == 200   # a new version
    wait_until(lambda: not first.exists(), "the replaced version's folder to go")
    [second] = folders(store, "ops")
    assert second != first and (second / "adapter_model.safetensors").is_file()
    assert call(server, "DELETE", "/v1/adapters/kept", KEYS["ops"]).status_code == 200
    wait_until(lambda: folders(store, "ops") == [], "the deleted adapter's folder to go")


def test_a_deleted_adapters_folder_stays_until_its_last_request_ends(server, adapter_root, store):
    assert upload(server, KEYS["ops"], "streaming", adapter_root, "attn-r4").status_code == 200
    [folder] = folders(store, "ops")
    body = {"model": "streaming", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEYS['ops']}"},
                      timeout=120) as client, client.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()          # kept: a dropped line iterator closes the stream
        assert next(lines).startswith("data: ")                      # it is generating on the adapter
        assert call(server, "DELETE", "/v1/adapters/streaming", KEYS["ops"]).status_code == 200
        assert folder.is_dir()                                       # still read by the running request
    wait_until(lambda: not folder.exists(), "the folder to go once the stream was closed")


def test_byte_quota_per_tenant(server, adapter_root, store):
    assert upload(server, KEYS["acme"], "one", adapter_root, "attn-r4").status_code == 200     # 67,840 B
    assert upload(server, KEYS["acme"], "two", adapter_root, "mlp-r8").status_code == 200      # 224,722 B in all
    over = error_of(upload(server, KEYS["acme"], "three", adapter_root, "attn-r4"), 403)
    assert over["code"] == "adapter_quota_exceeded"
    assert f"at most {ACME_QUOTA} bytes" in over["message"] and "max_adapter_bytes" in over["message"]
    assert len(folders(store, "acme")) == 2                    # the refused upload left nothing
    by_path = call(server, "POST", "/v1/adapters", KEYS["acme"], json={"name": "four", "path": "attn-r4"})
    assert error_of(by_path, 403)["code"] == "adapter_quota_exceeded"       # path loads count as well
    # Replacing an adapter frees its bytes: mlp-r8 -> attn-r4 under "two" fits.
    assert upload(server, KEYS["acme"], "two", adapter_root, "attn-r4").status_code == 200
    wait_until(lambda: len(folders(store, "acme")) == 1, "the replaced folder (and the duplicate) to go")
    listed = {a["name"] for a in call(server, "GET", "/v1/adapters", KEYS["acme"]).json()["data"]}
    assert {"one", "two"} <= listed and "three" not in listed


def test_an_upload_declared_over_the_quota_is_refused_unread(server, store):
    status, headers, body = raw_request(server, head("POST", "/v1/adapters", KEYS["tiny"],
                                                     "multipart/form-data; boundary=x", 70_000))
    assert status == 403 and b"max_adapter_bytes" in body and str(TINY_QUOTA).encode() in body
    assert headers["connection"] == "close"
    assert folders(store, "tiny") == []


def test_an_upload_without_a_length_is_411_for_a_tenant_with_a_byte_quota(server, store):
    """Without a Content-Length the whole upload (up to max_upload_bytes) would be spooled to disk before the
    quota could be checked; a tenant with a quota must say its size first."""
    request = head("POST", "/v1/adapters", KEYS["tiny"], "multipart/form-data; boundary=x", None)
    status, _, body = raw_request(server, request.replace("\n\n", "\nTransfer-Encoding: chunked\n\n"))
    assert status == 411 and b"Content-Length" in body and b"length_required" in body
    assert folders(store, "tiny") == []


def test_a_path_load_over_the_quota_by_its_file_sizes_is_refused_before_reading(server, adapter_root):
    """The quota is checked from the files' sizes on disk: a sparse 64 GiB weights file would take minutes to
    read (and then be refused); it is refused at once."""
    huge = adapter_root / "sparse-huge"
    huge.mkdir()
    try:
        (huge / "adapter_config.json").write_bytes((adapter_root / "attn-r4" / "adapter_config.json").read_bytes())
        with open(huge / "adapter_model.safetensors", "wb") as weights:
            weights.truncate(64 * 2 ** 30)
        began = time.monotonic()
        refused = call(server, "POST", "/v1/adapters", KEYS["acme"], json={"name": "huge", "path": "sparse-huge"})
        assert time.monotonic() - began < SLACK_S
        assert error_of(refused, 403)["code"] == "adapter_quota_exceeded"
        assert str(ACME_QUOTA) in refused.json()["error"]["message"]
    finally:
        shutil.rmtree(huge)


def test_concurrent_uploads_of_one_tenant_spool_at_most_its_quota(server):
    """Each upload's declared length counts against the tenant's quota while its body arrives: two uploads that
    fit alone but not together cannot both spool to disk."""
    half = ACME_QUOTA * 3 // 5
    with socket.create_connection(address(server), timeout=60) as first:
        first.sendall(head("POST", "/v1/adapters", KEYS["acme"], "multipart/form-data; boundary=x", half).encode()
                      + b"--x\r\n")
        def second() -> tuple[int, bytes]:
            status, _, body = raw_request(server, head("POST", "/v1/adapters", KEYS["acme"],
                                                       "multipart/form-data; boundary=x", half))
            return status, body
        wait_until(lambda: second()[0] == 403, "the first upload to be counted")
        status, body = second()
        assert b"being received" in body and str(ACME_QUOTA).encode() in body, body
    junk = b'--x\r\nContent-Disposition: form-data; name="junk"\r\n\r\n'
    form = junk + b"a" * (half - len(junk) - 9) + b"\r\n--x--\r\n"

    def after() -> int:           # the first one's count is released once the server sees it gone
        return raw_request(server, head("POST", "/v1/adapters", KEYS["acme"], "multipart/form-data; boundary=x",
                                        len(form)), form)[0]
    wait_until(lambda: after() == 400, "the first upload's bytes to be released")


# ---- 3. path errors are 400s -----------------------------------------------------------------------------------
def test_path_errors_are_400_naming_the_problem(server, adapter_root):
    loop = adapter_root / "loop-a"
    if not loop.is_symlink():
        loop.symlink_to(adapter_root / "loop-b")
        (adapter_root / "loop-b").symlink_to(loop)
    cases = {"a" * 300: "too long", f"attn-r4/{'b' * 256}": "too long", "loop-a": "loop",
             "x/" * 2040 + "y": "too long"}        # under the API's 4,096 characters, over the system's limit
    for path, words in cases.items():
        for route, body in (("/v1/adapters", {"name": "p", "path": path}),
                            ("/v1/load_lora_adapter", {"lora_name": "p", "lora_path": path})):
            error = error_of(call(server, "POST", route, KEYS["ops"], json=body), 400)
            assert words in error["message"] and str(adapter_root) not in error["message"], (path, error)
    surrogate = call(server, "POST", "/v1/load_lora_adapter", KEYS["ops"], content=b'{"lora_name": "p", '
                     b'"lora_path": "\\ud800"}', headers={"content-type": "application/json"})
    assert error_of(surrogate, 400)["param"] in ("lora_path", None)
    assert call(server, "GET", "/health").status_code == 200


# ---- 5. no slash redirect ----------------------------------------------------------------------------------------
def test_a_trailing_slash_is_a_plain_404(server):
    response = call(server, "GET", "/v1/models/", KEYS["acme"], headers={"Host": "evil.example"},
                    follow_redirects=False)
    assert response.status_code == 404 and "location" not in response.headers
    assert call(server, "GET", "/v1/models", KEYS["acme"]).status_code == 200


# ---- 7. /metrics behind an admin key ----------------------------------------------------------------------------
def test_metrics_need_an_admin_key(server):
    assert error_of(call(server, "GET", "/metrics"), 401)["code"] == "invalid_api_key"
    assert "admin" in error_of(call(server, "GET", "/metrics", KEYS["acme"]), 403)["message"]
    response = call(server, "GET", "/metrics", KEYS["ops"])
    assert response.status_code == 200
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert "slora_http_errors" in names and "slora_pool_pages" in names
    assert call(server, "GET", "/health").status_code == 200          # health stays open


# ---- 6. connection timeouts and cap ------------------------------------------------------------------------------
def test_a_silent_connection_is_closed_after_the_header_timeout(server):
    with socket.create_connection(address(server)) as sock:
        elapsed = closed_within(sock, HEADER_S + SLACK_S)
    assert elapsed >= HEADER_S - 0.5


def test_headers_sent_a_byte_at_a_time_do_not_extend_the_deadline(server):
    with socket.create_connection(address(server)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
        elapsed = closed_within(sock, HEADER_S + SLACK_S, drip=b"X")       # a header that never ends
    assert elapsed >= HEADER_S - 0.5


def test_a_body_that_stops_is_closed_after_the_body_timeout(server):
    with socket.create_connection(address(server)) as sock:
        sock.sendall(head("POST", "/v1/completions", KEYS["acme"], "application/json", 100).encode() + b'{"mo')
        elapsed = closed_within(sock, BODY_IDLE_S + SLACK_S)
    assert elapsed >= BODY_IDLE_S - 0.5


def test_an_idle_connection_is_closed_after_keep_alive(server):
    with socket.create_connection(address(server)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200 and response.read()
        elapsed = closed_within(sock, KEEP_ALIVE_S + SLACK_S)
    assert elapsed >= KEEP_ALIVE_S - 0.5


def test_over_the_connection_cap_requests_get_503_until_connections_close(server):
    holders = []
    try:
        for _ in range(MAX_CONNECTIONS):       # requests waiting for their bodies hold their connections
            sock = socket.create_connection(address(server))
            sock.sendall(head("POST", "/v1/completions", KEYS["acme"], "application/json", 100).encode())
            holders.append(sock)
        for sock in holders:                   # a body byte restarts each one's body timeout, however slow
            sock.sendall(b"{")                 # the machine was while they were opened
        assert call(server, "GET", "/health").status_code == 503
    finally:
        for sock in holders:
            sock.close()
    wait_until(lambda: call(server, "GET", "/health").status_code == 200, "the server to serve again")
    assert call(server, "GET", "/v1/models", KEYS["acme"]).status_code == 200


# ---- 8. a taken port -----------------------------------------------------------------------------------------
def test_a_taken_port_is_a_clear_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "slora.cli", "serve", "--port", str(port)],
                                capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0
    assert f"slora: error: cannot listen on 127.0.0.1:{port}: address already in use" in result.stderr
    assert "Traceback" not in result.stderr and "engine ready" not in result.stderr


# ---- 9. a CLI flag for every limit ---------------------------------------------------------------------------
def test_every_server_setting_has_a_flag_forwarded_into_the_settings(tmp_path):
    not_limits = {"host", "port", "tenants_file", "adapter_root", "adapter_store", "allow_unauthenticated",
                  "metrics_require_key", "lora_modules", "enable_lora_resolver", "served_model_names",
                  "enable_auto_tool_choice", "tool_call_parser"}
    fields = {f.name: f for f in dataclasses.fields(ServerSettings)}
    assert {field for _, field, _, _ in SERVE_LIMITS} == set(fields) - not_limits
    argv, expected = ["serve"], {}
    for i, (flag, field, kind, _) in enumerate(SERVE_LIMITS):
        value = kind(fields[field].default or 1) + 7 + i           # differs from the default
        argv += [flag, str(value)]
        expected[field] = value
    settings = serve_settings(build_parser().parse_args(argv))
    assert {field: getattr(settings, field) for field in expected} == expected
    defaults = serve_settings(build_parser().parse_args(["serve"]))
    assert defaults == ServerSettings()
    with pytest.raises(ValueError, match="max_connections"):
        serve_settings(build_parser().parse_args(["serve", "--max-connections", "0"]))
    with pytest.raises(ValueError, match="tenants file"):
        serve_settings(build_parser().parse_args(["serve", "--metrics-require-key"]))


def test_tenants_file_max_adapter_bytes_is_validated(tmp_path):
    from slora.api.tenants import load_tenants
    bad = tmp_path / "tenants.toml"
    for value, words in (("0", "max_adapter_bytes must be >= 1"), ('"big"', "max_adapter_bytes must be an integer")):
        bad.write_text(f'[tenants.a]\nkey_sha256 = "{hash_key("k")}"\nmax_adapter_bytes = {value}\n')
        with pytest.raises(ValueError, match=words):
            load_tenants(bad)
    bad.write_text(f'[tenants.a]\nkey_sha256 = "{hash_key("k")}"\nmax_adapter_bytes = 123\n')
    assert load_tenants(bad).get("a").max_adapter_bytes == 123
