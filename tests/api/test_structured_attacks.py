"""Structured output cannot freeze, starve or exhaust the server: while one tenant sends a compile bomb, a choice
bomb or an ambiguous grammar, another tenant's running stream keeps its pace (no gap between its tokens longer
than MAX_GAP_S), and the attacker gets a 4xx naming the limit. /health tells the truth throughout."""
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from conftest import BASE_MODEL, assert_error_shape, start_server, write_tenants

KEYS = {"mallory": "attacker-key", "bob": "victim-key", "carol": "bystander-key"}
MAX_GAP_S = 2.0
COMPILE_TIMEOUT_S = 2.0
COMPILE_BOMB = "(a*)" * 1000                      # minutes of xgrammar's time on the engine thread before
AMBIGUOUS = 'root ::= s\ns ::= s s s | s s | "a" | "aa" | ""'     # its per-token work grows as the cube


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("structured-attacks")
    tenants = write_tenants(folder, {name: {"key": key} for name, key in KEYS.items()})
    srv = start_server(folder, "--tenants", str(tenants), "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S),
                       "--grammar-max-pending", "2")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert "Traceback" not in srv.log()


class Pace:
    """A tenant's streams run back to back in a thread; the longest wait for a chunk (the first included)."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.gaps: list[float] = []
        self.chunks = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": BASE_MODEL, "prompt": "The story goes", "max_tokens": 300, "ignore_eos": True,
                "stream": True, "temperature": 0.0}
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120) as http:
            while not self._stop.is_set():
                last = time.monotonic()
                with http.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        self.errors.append(f"{response.status_code}: {response.read()[:200]!r}")
                        return
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            now = time.monotonic()
                            self.gaps.append(now - last)
                            self.chunks += 1
                            last = now

    @property
    def longest_gap(self) -> float:
        return max(self.gaps, default=float("inf"))

    @contextmanager
    def running(self) -> Iterator["Pace"]:
        self._thread.start()
        deadline = time.monotonic() + 120
        while self.chunks < 5 and time.monotonic() < deadline and not self.errors:      # streaming first
            time.sleep(0.05)
        self.gaps.clear()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=120)
        assert not self.errors, self.errors
        assert self.chunks > 20, "the victim's stream did not run during the attack"


def post(server, key: str, body: dict, timeout: float = 120) -> httpx.Response:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout) as http:
        return http.post("/v1/completions", json={"model": BASE_MODEL, "prompt": "hi", "max_tokens": 8, **body})


def test_a_compile_bomb_gets_a_400_naming_the_limit_and_others_keep_their_pace(server):
    with Pace(server.url, KEYS["bob"]).running() as pace:
        began = time.monotonic()
        response = post(server, KEYS["mallory"], {"structured_outputs": {"regex": COMPILE_BOMB}})
        took = time.monotonic() - began
        health = httpx.get(f"{server.url}/health", timeout=10)
    assert response.status_code == 400, response.text
    assert_error_shape(response.json(), 400)
    error = response.json()["error"]
    assert error["code"] == "grammar_too_complex" and "--grammar-compile-timeout" in error["message"], error
    assert error["param"] == "structured_outputs.regex", error
    assert took < 60, f"the bomb was answered after {took:.0f} s"
    assert pace.longest_gap < MAX_GAP_S, f"the victim waited {pace.longest_gap:.2f} s for a token"
    assert health.status_code == 200


def test_a_client_that_leaves_abandons_its_compile_and_the_next_request_is_quick(server):
    with pytest.raises(httpx.ReadTimeout):
        post(server, KEYS["mallory"], {"structured_outputs": {"regex": "(b*)" * 1000}}, timeout=0.5)
    began = time.monotonic()
    response = post(server, KEYS["carol"], {"max_tokens": 2})
    assert response.status_code == 200, response.text
    assert time.monotonic() - began < MAX_GAP_S


def test_a_tenant_may_not_queue_compiles_past_its_bound(server):
    results: list[int] = []

    def bomb(i: int) -> None:
        results.append(post(server, KEYS["mallory"], {"structured_outputs": {"regex": "(c*)" * (900 + i)}}
                            ).status_code)
    threads = [threading.Thread(target=bomb, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert sorted(results) == [400, 400, 429, 429], results      # two compile (and time out), two wait their turn


def test_a_choice_bomb_is_refused_before_any_compile(server):
    choices = [f"{i:04d}" + "x" * 1020 for i in range(1024)]                   # 1 MiB: 280 MB compiled before
    began = time.monotonic()
    response = post(server, KEYS["mallory"], {"structured_outputs": {"choice": choices}})
    assert response.status_code == 400, response.text
    assert "65536" in response.json()["error"]["message"]
    assert time.monotonic() - began < MAX_GAP_S


def test_an_ambiguous_grammar_is_stopped_and_others_keep_their_pace(server):
    with Pace(server.url, KEYS["bob"]).running() as pace:
        response = post(server, KEYS["mallory"], {"structured_outputs": {"grammar": AMBIGUOUS}, "max_tokens": 1000,
                                                  "min_tokens": 1000})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "grammar_too_slow" and "ms per token" in error["message"], error
    assert pace.longest_gap < MAX_GAP_S, f"the victim waited {pace.longest_gap:.2f} s for a token"


def test_a_schema_still_compiles_and_constrains(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response = post(server, KEYS["carol"], {"structured_outputs": {"json": schema}, "max_tokens": 40})
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert text.startswith("{"), text
