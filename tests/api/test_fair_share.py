"""A fair share per tenant over HTTP: a noisy neighbour under vtc and under fcfs, the tenants' view and metrics,
and request priorities.

Tenant A keeps far more long requests outstanding than the batch (two sequences) holds; tenant B sends a short
request every second. Under fcfs B's requests queue behind A's; under vtc (the default with a tenants file) B's
counter is the smaller, so each of B's requests waits at most for one of A's running requests to end."""
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from conftest import BASE_MODEL, Server, start_server, write_tenants

KEYS = {"a": "key-a", "b": "key-b", "root": "key-root", "idle": "key-idle"}
A_OUTSTANDING = 24          # A's requests in flight at any time: 2 run, 22 wait
A_TOKENS = 96               # an A request runs for about half a second here, several on a loaded 2-core machine
B_REQUESTS = 6
CLIENT_TIMEOUT_S = 900      # under fcfs B waits behind A's whole queue, minutes on a loaded machine


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    return write_tenants(tmp_path_factory.mktemp("fair"), {
        "a": {"key": KEYS["a"]}, "b": {"key": KEYS["b"], "weight": 2.0},
        "root": {"key": KEYS["root"], "role": "admin"}, "idle": {"key": KEYS["idle"]}})


def serve(tmp_path_factory, tenants_file, *args: str) -> Server:
    """A server whose batch holds two sequences, warmed up: its first steps are many times slower than the rest."""
    server = start_server(tmp_path_factory.mktemp("srv"), "--tenants", str(tenants_file), "--max-num-seqs", "2",
                          *args)
    with server.http(KEYS["root"]) as http:
        stream_completion(http, A_TOKENS)
    return server


@dataclass
class NoisyRun:
    b_ttft: list[float] = field(default_factory=list)
    a_run_s: list[float] = field(default_factory=list)      # an A request from its first token to its last
    errors: list[str] = field(default_factory=list)


def stream_completion(http: httpx.Client, max_tokens: int, stop: threading.Event | None = None
                      ) -> tuple[float, float] | None:
    """Stream one completion: (seconds to its first token, seconds from then to its end), or None if `stop` cut it."""
    body = {"model": BASE_MODEL, "prompt": "tell me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    first = None
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if stop is not None and stop.is_set():
                return None                             # closing the stream aborts the request
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.monotonic()
    assert first is not None, "the stream carried no token"
    return first - start, time.monotonic() - first


def flood(server: Server, run: NoisyRun, stop: threading.Event) -> None:
    with server.http(KEYS["a"], timeout=CLIENT_TIMEOUT_S) as http:
        while not stop.is_set():
            try:
                timing = stream_completion(http, A_TOKENS, stop)
            except httpx.HTTPError as exc:
                run.errors.append(f"A: {exc!r}")
                return
            if timing is not None:
                run.a_run_s.append(timing[1])


def one_b_request(server: Server, run: NoisyRun) -> None:
    with server.http(KEYS["b"], timeout=CLIENT_TIMEOUT_S) as http:
        try:
            timing = stream_completion(http, 2)
        except httpx.HTTPError as exc:
            run.errors.append(f"B: {exc!r}")
            return
        run.b_ttft.append(timing[0])


def noisy_neighbour(server: Server) -> NoisyRun:
    run, stop = NoisyRun(), threading.Event()
    floods = [threading.Thread(target=flood, args=(server, run, stop)) for _ in range(A_OUTSTANDING)]
    for thread in floods:
        thread.start()
    server.wait_for(lambda s: s.get("slora_sequences_waiting", 0) >= A_OUTSTANDING - 4, 120, "A's queue to build")
    bs = []
    for _ in range(B_REQUESTS):
        bs.append(threading.Thread(target=one_b_request, args=(server, run)))
        bs[-1].start()
        time.sleep(1.0)
    for thread in bs:
        thread.join(timeout=CLIENT_TIMEOUT_S)
    stop.set()
    for thread in floods:
        thread.join(timeout=CLIENT_TIMEOUT_S)
    assert not run.errors, run.errors
    assert len(run.b_ttft) == B_REQUESTS
    return run


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def test_a_flooding_tenant_does_not_hold_back_another_under_vtc(tmp_path_factory, tenants_file):
    fcfs_server = serve(tmp_path_factory, tenants_file, "--scheduling-policy", "fcfs")
    try:
        fcfs = noisy_neighbour(fcfs_server)
    finally:
        fcfs_server.stop()
    vtc_server = serve(tmp_path_factory, tenants_file)                  # vtc: the default with a tenants file
    try:
        vtc = noisy_neighbour(vtc_server)
        views = vtc_server.http(KEYS["root"]).get("/v1/tenants").json()
    finally:
        vtc_server.stop()
    assert views["scheduling_policy"] == "vtc"
    # First come first served makes B wait behind A's whole queue (about 14 s here), vtc for one of A's requests
    # (about 3 s): a wide margin, as a loaded machine narrows the gap.
    assert p99(vtc.b_ttft) * 3 <= p99(fcfs.b_ttft), (vtc.b_ttft, fcfs.b_ttft)
    # At worst B waits for one of A's two running requests to end (plus a step or two of its own).
    assert p99(vtc.b_ttft) <= max(vtc.a_run_s) + 0.5, (vtc.b_ttft, vtc.a_run_s)


@pytest.fixture(scope="module")
def vtc_server(tmp_path_factory, tenants_file):
    server = serve(tmp_path_factory, tenants_file)
    yield server
    server.stop()


def test_tenants_see_their_share_and_admins_see_everyones(vtc_server):
    with vtc_server.http(KEYS["a"]) as http:
        assert stream_completion(http, 3) is not None
    with vtc_server.http(KEYS["b"]) as http:
        assert stream_completion(http, 5) is not None
    vtc_server.wait_for(lambda s: s.get('slora_tenant_tokens_total{kind="output",tenant="b"}', 0) >= 5, 30,
                        "b's tokens in /metrics")
    with vtc_server.http(KEYS["root"]) as http:
        listing = http.get("/v1/tenants").json()
    by_id = {t["id"]: t for t in listing["data"]}
    assert sorted(by_id) == ["a", "b", "idle", "root"]
    assert by_id["b"]["weight"] == 2.0 and by_id["a"]["weight"] == 1.0
    assert by_id["a"]["output_tokens"] == 3 and by_id["b"]["output_tokens"] == 5
    assert by_id["b"]["prompt_tokens"] > 0 and by_id["idle"]["output_tokens"] == by_id["idle"]["prompt_tokens"] == 0
    # b arrived with nobody waiting: lifted to the counter of a, the last to leave the queue (idling earns no
    # credit); then charged half, at its weight of 2, for its prompt at 1 a token and its 5 tokens at 2.
    b_charge = (by_id["b"]["prompt_tokens"] + 2 * 5) / 2
    assert by_id["b"]["virtual_tokens"] == pytest.approx(by_id["a"]["virtual_tokens"] + b_charge)
    with vtc_server.http(KEYS["a"]) as http:
        own = http.get("/v1/tenants").json()["data"]
    assert [t["id"] for t in own] == ["a"]
    samples = vtc_server.metrics()
    assert samples['slora_tenant_tokens_total{kind="output",tenant="a"}'] == 3
    assert samples['slora_tenant_virtual_tokens{tenant="b"}'] == by_id["b"]["virtual_tokens"]


def test_priority_is_taken_under_vtc(vtc_server):
    with vtc_server.http(KEYS["a"]) as http:
        body = {"model": BASE_MODEL, "prompt": "hi", "max_tokens": 2, "priority": -3}
        assert http.post("/v1/completions", json=body).status_code == 200
        body["priority"] = 2 ** 40
        error = http.post("/v1/completions", json=body)
        assert error.status_code == 400 and error.json()["error"]["param"] == "priority"
