"""`slora serve --replicas 2`: the single server's API in front of two engine replicas on Ray Serve. The
package's local Ray cluster (conftest.py), joined by the server with --ray-address, so that the test can read the
replicas' counts; the tiny model on the CPU, two tenants. Greedy outputs must equal the offline LLM's."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")        # a guard only: `make test` installs the ray extra
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402
from servers import free_port, wait_healthy, write_tenants  # noqa: E402
from tiny import make_adapters  # noqa: E402

from slora import LLM, SamplingParams  # noqa: E402
from slora.api.cluster import REPLICAS_APP  # noqa: E402
from slora.api.replica import ReplicaStats  # noqa: E402

BASE_MODEL = "slora-tiny-llama"
NUM_REPLICAS = 2
KEYS = {"alice": "key-alice", "bob": "key-bob"}
TENANTS = {name: {"key": key} for name, key in KEYS.items()}
PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy", "Hello there"]
MAX_TOKENS = 8
# A replica pushes the versions it holds every 0.1 s, to Ray's controller, which passes them on to the ingress's
# router; until then a version's requests are routed as an unknown one's. Generous for a loaded 2-core machine.
ROUTING_SETTLE_S = 2.0


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory) -> Path:
    from slora.models.tiny import ensure_tiny_model
    root = tmp_path_factory.mktemp("adapter-root")
    make_adapters(ensure_tiny_model().model_dir, root, ["attn-r4", "mlp-r8"])
    return root


@pytest.fixture(scope="module")
def offline(adapter_root) -> LLM:
    llm = LLM(BASE_MODEL)
    for name in ("attn-r4", "mlp-r8"):
        llm.load_adapter(name, str(adapter_root / name))
    return llm


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory):
    """`slora serve --replicas 2` joined to the module's cluster; its URL."""
    folder = tmp_path_factory.mktemp("ingress")
    port = free_port()
    log_path = folder / "server.log"
    args = ["--model", BASE_MODEL, "--host", "127.0.0.1", "--port", str(port), "--replicas", str(NUM_REPLICAS),
            "--ray-address", cluster, "--replica-gpus", "0", "--replica-cpus", "0.5",
            "--tenants", str(write_tenants(folder, TENANTS)), "--adapter-store", str(folder / "store")]
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "slora.cli", "serve", *args], stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log_path)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _http(url: str, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=120)


def _upload(client: httpx.Client, adapter_root: Path, source: str, name: str) -> dict:
    folder = adapter_root / source
    files = {"adapter_config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
             "adapter_model": ("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes())}
    response = client.post("/v1/adapters", data={"name": name}, files=files)
    assert response.status_code == 200, response.text
    return response.json()


def _completion(client: httpx.Client, model: str, prompt: str) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _expected(offline: LLM, adapter: str | None, prompt: str) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return offline.generate([prompt], params, adapters=[adapter])[0].token_ids


def _replica_stats(timeout_s: float = 10.0) -> dict[str, ReplicaStats]:
    """Each replica's counts: asked until both have answered (Ray routes each ask to one of them)."""
    handle = serve.get_deployment_handle("EngineReplica", app_name=REPLICAS_APP)
    stats: dict[str, ReplicaStats] = {}
    deadline = time.monotonic() + timeout_s
    while len(stats) < NUM_REPLICAS and time.monotonic() < deadline:
        one = handle.load_count.remote().result()
        stats[one.replica_id] = one
    assert len(stats) == NUM_REPLICAS, stats
    return stats


def test_uploaded_adapter_is_served_as_offline_and_private(server, adapter_root, offline):
    with _http(server, "alice") as alice, _http(server, "bob") as bob:
        info = _upload(alice, adapter_root, "attn-r4", "mine")
        first = _completion(alice, "mine", PROMPTS[0])          # loads the version on one replica
        time.sleep(ROUTING_SETTLE_S)
        rest = [_completion(alice, "mine", p) for p in PROMPTS[1:]]
        assert [first, *rest] == [_expected(offline, "attn-r4", p) for p in PROMPTS]
        assert bob.post("/v1/completions", json={"model": "mine", "prompt": "hi", "max_tokens": 2}).status_code == 404
        assert "mine" in {card["id"] for card in alice.get("/v1/models").json()["data"]}
        assert "mine" not in {card["id"] for card in bob.get("/v1/models").json()["data"]}
        assert _completion(bob, BASE_MODEL, PROMPTS[0]) == _expected(offline, None, PROMPTS[0])
    served = {rid: s.requests.get(info["version"], 0) for rid, s in _replica_stats().items()}
    assert sorted(served.values()) == [0, len(PROMPTS)], served     # one replica served all of them


def test_each_adapter_stays_on_one_replica(server, adapter_root, offline):
    with _http(server, "bob") as bob:
        info = _upload(bob, adapter_root, "mlp-r8", "bobs")
        assert _completion(bob, "bobs", PROMPTS[0]) == _expected(offline, "mlp-r8", PROMPTS[0])
        time.sleep(ROUTING_SETTLE_S)
        for prompt in PROMPTS * 2:
            assert _completion(bob, "bobs", prompt) == _expected(offline, "mlp-r8", prompt)
    loads = {rid: s.loads.get(info["version"], 0) for rid, s in _replica_stats().items()}
    assert sorted(loads.values()) == [0, 1], loads


def _stream_lines(client: httpx.Client, max_tokens: int):
    body = {"model": BASE_MODEL, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        yield from (line for line in response.iter_lines() if line.startswith("data: "))


def test_structured_output_is_compiled_on_the_replica(server):
    """The ingress sends the structured spec, not its compiled grammar (which may not pickle)."""
    with _http(server, "alice") as alice:
        for choices in (["yes", "no"], ["alpha", "beta", "gamma"]):
            body = {"model": BASE_MODEL, "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0.0,
                    "guided_choice": choices}
            response = alice.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] in choices


def test_a_client_that_leaves_stops_its_request_on_the_replica(server):
    with _http(server, "bob") as bob:
        lines = _stream_lines(bob, 1500)
        assert '"choices"' in next(lines)
        lines.close()                   # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while True:
        stats = _replica_stats().values()
        if sum(s.abandoned for s in stats) >= 1 and all(s.running == 0 for s in stats):
            return
        assert time.monotonic() < deadline, f"the request still runs on its replica: {stats}"
        time.sleep(0.2)


def test_reuploaded_adapter_is_served_after_an_unload(server, adapter_root, offline):
    """The replicas hold the version from its first upload's folder, deleted by the unload; they read the new one."""
    with _http(server, "alice") as alice:
        first = _upload(alice, adapter_root, "mlp-r8", "again")
        assert _completion(alice, "again", PROMPTS[3]) == _expected(offline, "mlp-r8", PROMPTS[3])
        assert alice.delete("/v1/adapters/again").status_code == 200
        assert alice.post("/v1/completions", json={"model": "again", "prompt": "hi"}).status_code == 404
        second = _upload(alice, adapter_root, "mlp-r8", "again")
        assert second["version"] == first["version"]
        assert [_completion(alice, "again", p) for p in PROMPTS] == [_expected(offline, "mlp-r8", p) for p in PROMPTS]


class Scrape:
    def __init__(self, text: str) -> None:
        self.families = {family.name: family for family in text_string_to_metric_families(text)}

    def by_replica(self, name: str) -> dict[str, float]:
        return {s.labels["replica"]: s.value for s in self.families[name].samples}

    def adapter_names(self) -> set[str]:
        return {s.labels["adapter_name"] for s in self.families["vllm:lora_adapter_loaded"].samples}


def _scrape(client: httpx.Client) -> Scrape:
    response = client.get("/metrics")
    assert response.status_code == 200
    return Scrape(response.text)


def test_metrics_give_each_replicas_series(server, adapter_root):
    with _http(server, "alice") as alice, _http(server, "bob") as bob:
        _upload(alice, adapter_root, "attn-r4", "scraped")
        _completion(alice, "scraped", PROMPTS[0])
        replicas = set(_replica_stats())
        deadline = time.monotonic() + 20
        while set((scrape := _scrape(alice)).by_replica("vllm:num_requests_running")) != replicas:
            assert time.monotonic() < deadline, "the replicas' series did not reach the ingress"
            time.sleep(0.5)
        assert set(scrape.by_replica("vllm:kv_cache_usage_perc")) == replicas
        assert set(scrape.by_replica("slora_pool_capacity_pages")) == replicas
        assert "scraped" in scrape.adapter_names()          # alice's own adapter, under the name she gave it
        assert "scraped" not in _scrape(bob).adapter_names()
        lines = _stream_lines(bob, 1500)                      # the series move while a request runs
        assert '"choices"' in next(lines)
        while sum(_scrape(bob).by_replica("vllm:num_requests_running").values()) < 1:
            assert time.monotonic() < deadline + 20, "no replica's running count moved"
            time.sleep(0.3)
        lines.close()


def _kill_busy_replica() -> ReplicaStats:
    """ray.kill the actor of a replica running a request, as a crashed replica dies; its stats before."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        busy = [s for s in _replica_stats().values() if s.running > 0]
        if busy:
            ray.kill(ray.get_actor(busy[0].actor_name, namespace="serve"))
            return busy[0]
        time.sleep(0.1)
    raise AssertionError("no replica ran the requests")


def _streams_on_both_replicas(client: httpx.Client, max_tokens: int) -> list[tuple[threading.Thread, list[str]]]:
    """Long streams started one by one until both replicas run some (Ray routes base requests by load);
    each read to its end on a thread of its own, its lines kept."""
    streams: list[tuple[threading.Thread, list[str]]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines: list[str] = []
        reader = threading.Thread(target=lambda kept=lines: kept.extend(_stream_lines(client, max_tokens)))
        reader.start()
        streams.append((reader, lines))
        time.sleep(0.3)
        if all(s.running > 0 for s in _replica_stats().values()):
            return streams
    raise AssertionError("the streams did not reach both replicas")


def test_a_replica_killed_mid_stream_ends_only_its_streams(server, offline):
    with _http(server, "alice") as alice:
        streams = _streams_on_both_replicas(alice, 2000)     # near the model's 2,048: still running at the kill
        killed = _kill_busy_replica()
        began = time.monotonic()
        for reader, _ in streams:
            reader.join(timeout=90)
        assert time.monotonic() - began < 90 and not any(reader.is_alive() for reader, _ in streams), \
            "a stream went on long after its replica died"
        failed = [lines for _, lines in streams if any('"error"' in line for line in lines)]
        assert all(lines[-1] == "data: [DONE]" for _, lines in streams)
        # The killed replica's streams ended with an error event; those on the other replica ran to the end.
        assert 0 < len(failed) < len(streams) and killed.running > 0, [s[-2:] for _, s in streams]
        _wait_served_again(alice, offline)


def _wait_served_again(client: httpx.Client, offline: LLM) -> None:
    """Requests succeed again once Ray has replaced the replica (those sent to the dead one first fail)."""
    expected = _expected(offline, None, PROMPTS[1])
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        body = {"model": BASE_MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        response = client.post("/v1/completions", json=body)
        if response.status_code == 200 and response.json()["choices"][0]["token_ids"] == expected:
            _replica_stats(timeout_s=180)     # and Ray has started a replica in place of the dead one
            return
        time.sleep(0.5)
    raise AssertionError("requests did not succeed again after the replica died")
