"""Connections under attack, against a real server: floods of connections that send nothing, from one client
address and from many (127.0.0.2 and up: Linux routes all of 127/8 over loopback, and the server on 127.0.0.1
sees each as another client), the reserve of request slots for /health and keyed requests, over-cap answers as
JSON errors, bodies dripped below the minimum rate, and the Allow header of 405 answers."""
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from conftest import BASE_MODEL, SOAK, assert_error_shape, start_server, wait_until, write_tenants

KEYS = {"alpha": "conn-alpha-key", "beta": "conn-beta-key"}
MAX_CONNECTIONS = 100
RESERVE = 10                       # the default: 10% of MAX_CONNECTIONS
PER_CLIENT = 8
HEADER_S, BODY_IDLE_S, MIN_BODY_RATE = 5.0, 3.0, 256
SLACK_S = 5.0                      # on top of a deadline, for a loaded 2-core machine
ATTACKERS = [f"127.0.0.{i}" for i in range(2, 51)]       # 49 addresses x PER_CLIENT: far over MAX_CONNECTIONS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("connections")
    tenants = write_tenants(folder, {"alpha": {"key": KEYS["alpha"]}, "beta": {"key": KEYS["beta"]}})
    srv = start_server(folder, "--tenants", str(tenants), "--max-connections", str(MAX_CONNECTIONS),
                       "--max-connections-per-client", str(PER_CLIENT), "--timeout-header", str(HEADER_S),
                       "--timeout-body-idle", str(BODY_IDLE_S), "--min-body-rate", str(MIN_BODY_RATE))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


# ---- helpers ------------------------------------------------------------------------------------------------
def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def connect(server, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(address(server))
    return sock


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (it never answers an idle connection)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def completion(server, key: str, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": BASE_MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens})


def health(server) -> int:
    return httpx.get(f"{server.url}/health", timeout=60).status_code


def stream_gaps(server, key: str, max_tokens: int, out: dict) -> None:
    """Stream a completion; out["gaps"] are the seconds between its events, out["tokens"] their tokens."""
    body = {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "return_token_ids": True}
    times, tokens = [], 0
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        out["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                tokens += sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
    out["gaps"] = [b - a for a, b in zip(times, times[1:])]
    out["tokens"] = tokens


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.headers
    assert_error_shape(response.json(), status)
    return response.json()["error"]


def request_head(key: str | None, length: int, path: str = "/v1/completions") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@contextmanager
def holders(server, count: int, first: int) -> Iterator[list[socket.socket]]:
    """`count` keyed requests in progress: each sends its head and then its (never finished) body at 1 KiB/s,
    above the minimum rate. Each from an address of its own (127.0.1.<first + i>), so that the ones whose head
    the server has not read yet do not pass one address's idle cap."""
    socks = [connect(server, f"127.0.1.{first + i}") for i in range(count)]
    stop = threading.Event()

    def feed() -> None:
        while not stop.wait(0.5):
            for sock in socks:
                sock.sendall(b" " * 512)
    for sock in socks:
        sock.sendall(request_head(KEYS["alpha"], 1_000_000) + b"{")
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        yield socks
    finally:
        stop.set()
        feeder.join()
        for sock in socks:
            sock.close()


# ---- idle connections ----------------------------------------------------------------------------------------
def test_one_address_keeps_at_most_its_cap_of_idle_connections_newest_first(server):
    socks = []
    try:
        for _ in range(PER_CLIENT + 12):
            socks.append(connect(server, "127.0.0.2"))
            time.sleep(0.02)                          # the server sees them in this order
        wait_until(lambda: sum(map(is_closed, socks)) >= 12, "the oldest 12 to be closed", HEADER_S)
        assert [is_closed(sock) for sock in socks] == [True] * 12 + [False] * PER_CLIENT
        assert completion(server, KEYS["alpha"]).status_code == 200      # another address is not affected
    finally:
        for sock in socks:
            sock.close()


def test_over_the_global_bound_a_client_holding_one_idle_connection_keeps_it(server):
    """Beyond MAX_CONNECTIONS idle connections, the oldest of the addresses holding the most go first: a client
    with one idle connection keeps it, even the oldest of all."""
    own = connect(server)
    flood = []
    try:
        time.sleep(0.1)
        for source in ATTACKERS[:13]:                 # 13 x 8 = 104, with `own` 5 over the bound
            flood += [connect(server, source) for _ in range(PER_CLIENT)]
        wait_until(lambda: sum(map(is_closed, flood)) >= 5, "5 idle connections to be closed", HEADER_S)
        assert not is_closed(own)
        assert not any(is_closed(sock) for sock in flood[-PER_CLIENT:])    # the last address's are the newest
        own.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")        # and it is served
        answer = http.client.HTTPResponse(own)
        answer.begin()
        assert answer.status == 200
    finally:
        for sock in [own, *flood]:
            sock.close()


def test_an_idle_flood_from_one_address_does_not_slow_other_clients(server):
    result: dict = {}
    streamer = threading.Thread(target=stream_gaps, args=(server, KEYS["beta"], 600, result))
    with SOAK.IdleFlood(server.url, ["127.0.0.2"], PER_CLIENT * 8) as flood:
        streamer.start()
        statuses = [completion(server, KEYS["alpha"]).status_code for _ in range(20)]
        healths = [health(server) for _ in range(5)]
        streamer.join(timeout=120)
    assert statuses == [200] * 20 and healths == [200] * 5
    assert result["status"] == 200 and result["tokens"] == 600
    assert max(result["gaps"]) < 2.0, max(result["gaps"])
    stats = flood.stats()
    assert stats["opened"] > 10 * PER_CLIENT and stats["closed_by_server"] > 9 * PER_CLIENT, stats


def test_an_idle_flood_from_many_addresses_over_the_global_bound_spares_keyed_requests(server):
    with SOAK.IdleFlood(server.url, ATTACKERS, PER_CLIENT) as flood:
        wait_until(lambda: flood.stats()["opened"] >= len(ATTACKERS) * PER_CLIENT, "the flood to open")
        statuses = [completion(server, KEYS["alpha"]).status_code for _ in range(20)]
        healths = [health(server) for _ in range(5)]
        stats = flood.stats()
    assert statuses == [200] * 20 and healths == [200] * 5
    assert stats["closed_by_server"] >= len(ATTACKERS) * PER_CLIENT - MAX_CONNECTIONS, stats


# ---- requests in progress: the cap and the reserve ----------------------------------------------------------
def test_the_reserve_keeps_slots_for_health_and_keyed_requests_and_over_cap_answers_are_json(server):
    with holders(server, MAX_CONNECTIONS - RESERVE, 1):
        wait_until(lambda: httpx.get(f"{server.url}/openapi.json", timeout=60).status_code == 503,
                   "the unreserved slots to be taken")
        refused = httpx.get(f"{server.url}/openapi.json", timeout=60)
        assert error_of(refused, 503)["code"] == "server_overloaded"
        assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
        unkeyed = httpx.post(f"{server.url}/v1/completions", json={"model": BASE_MODEL, "prompt": "hi"}, timeout=60)
        assert error_of(unkeyed, 503)["code"] == "server_overloaded"          # refused before its key is read
        assert completion(server, KEYS["beta"]).status_code == 200
        assert health(server) == 200
        with holders(server, RESERVE, MAX_CONNECTIONS - RESERVE + 1):
            wait_until(lambda: health(server) == 503, "every slot to be taken")
            assert error_of(completion(server, KEYS["beta"]), 503)["code"] == "server_overloaded"
            assert error_of(httpx.get(f"{server.url}/health", timeout=60), 503)["code"] == "server_overloaded"
    wait_until(lambda: httpx.get(f"{server.url}/openapi.json", timeout=60).status_code == 200, "the slots to free")
    assert completion(server, KEYS["beta"]).status_code == 200


# ---- bodies ---------------------------------------------------------------------------------------------------
def test_a_body_dripped_below_the_minimum_rate_is_cut_off_with_408(server):
    with connect(server) as sock:
        sock.sendall(request_head(KEYS["alpha"], 1_000) + b"{")
        began = time.monotonic()
        sock.settimeout(0.5)
        answer = b""
        while time.monotonic() - began < BODY_IDLE_S + SLACK_S:
            try:
                sock.sendall(b" ")                   # a byte every 0.5 s: never idle, far below the rate
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - began
    assert BODY_IDLE_S - 0.5 <= elapsed < BODY_IDLE_S + SLACK_S, elapsed
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"content-type: application/json" in head.lower(), answer
    error = json.loads(body)
    assert_error_shape(error, 408)
    assert error["error"]["code"] == "request_timeout" and f"{MIN_BODY_RATE}" in error["error"]["message"]


def test_a_slow_body_above_the_minimum_rate_is_served(server):
    body = json.dumps({"model": BASE_MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    body += b" " * (2_400 - len(body))              # 300 bytes every 0.5 s: 4 s, over a whole rate window
    with connect(server) as sock:
        sock.sendall(request_head(KEYS["alpha"], len(body)))
        for start in range(0, len(body), 300):
            sock.sendall(body[start:start + 300])
            time.sleep(0.5)
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        assert answer.status == 200, answer.read()
        assert json.loads(answer.read())["usage"]["completion_tokens"] == 1


# ---- 405 --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("OPTIONS", "/v1/completions", "POST"), ("OPTIONS", "/health", "GET"), ("PUT", "/v1/adapters", "GET, POST"),
    ("OPTIONS", "/v1/adapters", "GET, POST"), ("PATCH", "/v1/adapters/some-name", "DELETE"),
    ("POST", "/v1/models/x", "GET")])
def test_405_names_every_method_of_the_path(server, method, path, allowed):
    response = httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {KEYS['alpha']}"},
                             timeout=60)
    error = error_of(response, 405)
    assert response.headers["allow"] == allowed
    assert error["code"] == "method_not_allowed" and allowed in error["message"] and method in error["message"]
