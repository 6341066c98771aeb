"""Engine replicas on Ray Serve (slora.api.replica), driven through a DeploymentHandle as the ingress will drive
them: the package's local Ray cluster (conftest.py), two replicas of the tiny model on the CPU, eight adapters routed by
their version id as Ray's multiplexed model id. Greedy outputs must equal the offline LLM's, token for token."""
import asyncio
import concurrent.futures
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")        # a guard only: `make test` installs the ray extra
from ray import serve  # noqa: E402
from tiny import edit_weights, random_prompts  # noqa: E402

from slora import LLM, RequestOutput, SamplingParams  # noqa: E402
from slora.api.replica import Autoscaling, ReplicaRequest, ReplicaStats, board, replica_app  # noqa: E402
from slora.config import EngineConfig  # noqa: E402

BASE_MODEL = "slora-tiny-llama"
NUM_REPLICAS = 2
NUM_ADAPTERS = 8
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
# The replicas push the versions they hold to the controller every 0.1 s, which passes them on to the
# handle's router; a version's next requests follow it once the router has them.
ROUTING_SETTLE_S = 1.0
REPLICAS_APP = "slora-replicas"
SMALL_APP = "slora-two-adapters"


@dataclass(frozen=True)
class Adapter:
    folder: Path
    version: str


@dataclass(frozen=True)
class Adapters:
    served: list[Adapter]
    ghost: Adapter          # made and hashed, never served from its own folder


def _variant(source: Path, folder: Path, seed: int) -> Path:
    """A distinct PEFT folder of the tiny model: a demo adapter's files with its B matrices rescaled and
    perturbed (a new content hash, and outputs of its own)."""
    shutil.copytree(source, folder)
    generator = torch.Generator().manual_seed(seed)

    def perturb(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if "lora_B" in name:
                noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
                tensors[name] = tensor * (1.0 + 0.25 * seed) + 0.5 * noise
    edit_weights(folder, perturb)
    return folder


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The reference: one offline engine of the same model with every served adapter loaded."""
    return LLM(BASE_MODEL)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, offline: LLM) -> Adapters:
    from slora.models.tiny import ensure_tiny_model

    root = tmp_path_factory.mktemp("shared-adapters")       # what the ingress's shared store would be
    sources = sorted(ensure_tiny_model().adapters.values())
    folders = [_variant(sources[i % len(sources)], root / f"adapter-{i}", i + 1) for i in range(NUM_ADAPTERS + 1)]
    served = [Adapter(folder, offline.load_adapter(folder.name, str(folder))) for folder in folders[:-1]]
    ghost = Adapter(folders[-1], offline.engine.adapters.prepare(folders[-1]).version)
    assert len({a.version for a in [*served, ghost]}) == NUM_ADAPTERS + 1, "each adapter has a content of its own"
    return Adapters(served, ghost)


@pytest.fixture(scope="module")
def replicas(cluster):
    """Two engine replicas of the tiny model; the handle the ingress would hold."""
    app = replica_app(EngineConfig(model=BASE_MODEL), NUM_REPLICAS, num_gpus=0, num_cpus=0.5, max_adapters=1024)
    return serve.run(app, name=REPLICAS_APP, route_prefix=None)


@pytest.fixture(scope="module")
def small_replica(cluster):
    """One replica that keeps two versions at most: Ray evicts the least recently used."""
    app = replica_app(EngineConfig(model=BASE_MODEL), 1, num_gpus=0, num_cpus=0.5, max_adapters=2)
    return serve.run(app, name=SMALL_APP, route_prefix=None)


def submit(handle, request: ReplicaRequest):
    """Send as the ingress does: streamed, routed by the adapter's version."""
    options = {"stream": True, "method_name": "generate"}
    if request.adapter_version is not None:
        options["multiplexed_model_id"] = request.adapter_version
    return handle.options(**options).remote(request)


def final(stream) -> RequestOutput:
    outputs = list(stream)
    assert outputs and outputs[-1].finished, outputs
    assert all(isinstance(o, RequestOutput) for o in outputs)
    return outputs[-1]


def request(request_id: str, prompt: list[int], adapter: Adapter | None, folder: Path | None = None,
            params: SamplingParams = GREEDY, owner: str | None = None) -> ReplicaRequest:
    if adapter is None:
        return ReplicaRequest(request_id, prompt, params, owner=owner)
    return ReplicaRequest(request_id, prompt, params, adapter.version, str(folder or adapter.folder), owner=owner)


def run_all(handle, requests: list[ReplicaRequest]) -> dict[str, RequestOutput]:
    """All sent before any is read: they run concurrently on the replicas."""
    streams = [(r.request_id, submit(handle, r)) for r in requests]
    return {request_id: final(stream) for request_id, stream in streams}


def expected(offline: LLM, requests: Iterable[ReplicaRequest], names: dict[str, str]) -> dict[str, list[int]]:
    """Greedy tokens of the offline engine for the same prompts and adapters (loaded there under `names`)."""
    requests = list(requests)
    outputs = offline.generate([r.prompt_token_ids for r in requests], [r.params for r in requests],
                               adapters=[names[r.adapter_version] if r.adapter_version else None for r in requests])
    return {r.request_id: o.token_ids for r, o in zip(requests, outputs)}


def replica_stats(handle, count: int, attempts: int = 200) -> list[ReplicaStats]:
    """The stats of every replica: calls without a model id go to either, so call until each has answered."""
    seen: dict[str, ReplicaStats] = {}
    for _ in range(attempts):
        stats = handle.load_count.remote().result()
        seen.setdefault(stats.replica_id, stats)
        if len(seen) == count:
            return list(seen.values())
    raise AssertionError(f"only replicas {sorted(seen)} answered in {attempts} calls")


def adapter_names(adapters: Adapters) -> dict[str, str]:
    return {a.version: a.folder.name for a in adapters.served}


def test_adapters_stay_on_one_replica_and_match_offline(replicas, adapters: Adapters, offline: LLM) -> None:
    served = adapters.served
    prompts = random_prompts([5 + i % 7 for i in range(4 * NUM_ADAPTERS + 8)], seed=3)
    # First each adapter once, with base requests, so that every replica holds some; then three requests
    # per adapter at once, mixed with base requests, once the router knows where each version is.
    warm = [request(f"warm-{i}", prompts[i], a) for i, a in enumerate(served)]
    warm += [request(f"warm-base-{i}", prompts[NUM_ADAPTERS + i], None, owner="tenant-a") for i in range(4)]
    outputs = run_all(replicas, warm)
    time.sleep(ROUTING_SETTLE_S)
    burst = [request(f"burst-{k}-{i}", prompts[NUM_ADAPTERS + 4 + 3 * i + k], a, owner=f"tenant-{k}")
             for k in range(3) for i, a in enumerate(served)]
    burst[4:4] = [request(f"burst-base-{i}", prompts[-4 + i], None) for i in range(4)]
    outputs |= run_all(replicas, burst)

    want = expected(offline, [*warm, *burst], adapter_names(adapters))
    assert {i: o.token_ids for i, o in outputs.items()} == want
    base = expected(offline, [request(r.request_id, r.prompt_token_ids, None) for r in warm[:NUM_ADAPTERS]], {})
    assert sum(base[r.request_id] != want[r.request_id] for r in warm[:NUM_ADAPTERS]) >= NUM_ADAPTERS // 2, \
        "the adapters change the outputs: the comparison above tests them"

    stats = replica_stats(replicas, NUM_REPLICAS)
    for adapter in served:
        holders = [s.replica_id for s in stats if s.requests.get(adapter.version)]
        assert len(holders) == 1, f"adapter {adapter.folder.name} ran on {holders}"
        assert sum(s.requests.get(adapter.version, 0) for s in stats) == 4
        assert [s.loads.get(adapter.version, 0) for s in stats if s.replica_id != holders[0]] == [0]
        assert [s.loads[adapter.version] for s in stats if s.replica_id == holders[0]] == [1]
    assert sum(s.base_requests for s in stats) == 8
    assert all(not s.evictions and s.running == 0 and s.abandoned == 0 for s in stats)


def test_wrong_folder_or_route_fails_alone(replicas, adapters: Adapters, offline: LLM) -> None:
    served, ghost = adapters.served, adapters.ghost
    prompts = random_prompts([6, 7, 8, 9, 10], seed=11)
    wrong = submit(replicas, request("wrong-folder", prompts[0], ghost, folder=served[1].folder))
    others = [request(f"beside-{i}", p, served[i] if i % 2 else None) for i, p in enumerate(prompts[1:])]
    outputs = run_all(replicas, others)
    with pytest.raises(ValueError, match=ghost.version):
        list(wrong)
    misrouted = replicas.options(stream=True, method_name="generate", multiplexed_model_id=served[2].version)
    with pytest.raises(ValueError, match="routed with multiplexed model id"):
        list(misrouted.remote(request("misrouted", prompts[0], served[0])))
    assert {i: o.token_ids for i, o in outputs.items()} == expected(offline, others, adapter_names(adapters))
    stats = replica_stats(replicas, NUM_REPLICAS)
    assert all(ghost.version not in s.loads and ghost.version not in s.engine_versions for s in stats)


def test_evicted_adapter_leaves_the_engine_and_loads_again(small_replica, adapters: Adapters,
                                                            offline: LLM) -> None:
    first, second, third = adapters.served[:3]
    prompts = random_prompts([7, 8, 9, 10], seed=21)
    order = [first, second, third, first]         # the third evicts the first, which then evicts the second
    outputs = {}
    for i, adapter in enumerate(order):
        outputs |= run_all(small_replica, [request(f"lru-{i}", prompts[i], adapter)])
    requests = [request(f"lru-{i}", prompts[i], a) for i, a in enumerate(order)]
    assert {i: o.token_ids for i, o in outputs.items()} == expected(offline, requests, adapter_names(adapters))
    [stats] = replica_stats(small_replica, 1)
    assert stats.loads == {first.version: 2, second.version: 1, third.version: 1}
    assert stats.evictions == {first.version: 1, second.version: 1}
    assert second.version not in stats.engine_versions          # its name gone and nothing running: dropped
    assert {first.version, third.version} <= set(stats.engine_versions)


def test_request_abandoned_by_its_consumer_is_aborted(small_replica, adapters: Adapters) -> None:
    max_tokens = 2000
    long = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stream = submit(small_replica, request("abandoned", [5, 6, 7, 8], adapters.served[3], params=long))
    assert not next(iter(stream)).finished
    stream.cancel()
    deadline = time.monotonic() + 60
    while (stats := replica_stats(small_replica, 1)[0]).running and time.monotonic() < deadline:
        time.sleep(0.2)
    # Ended by the abort, not by running out its tokens: far fewer steps than one per token.
    assert stats.running == 0 and stats.abandoned == 1 and stats.engine_steps < max_tokens // 4, stats


def test_request_aborted_on_the_board_stops_though_its_stream_is_not_cancelled(small_replica) -> None:
    """The ingress posts every abort to the board too: Ray's cancel is best effort, and a lost one (a stream
    never cancelled, here) would leave the replica generating for nobody."""
    max_tokens = 2000
    before = replica_stats(small_replica, 1)[0].abandoned
    long = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = iter(submit(small_replica, request("on-the-board", [5, 6, 7, 8], None, params=long)))
    assert not next(outputs).finished
    ray.get(board(SMALL_APP).abort.remote("on-the-board"))
    last = list(outputs)[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort" and len(last.token_ids) < max_tokens, last
    assert replica_stats(small_replica, 1)[0].abandoned == before + 1


@pytest.fixture(scope="module")
def streams_loop():
    """An event loop on a thread of its own, from which the tests stream as the ingress does (Ray's autoscaler
    counts the ongoing requests of async streams; a stream iterated synchronously on a thread is not counted)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def _stream_all(loop, handle, requests: list[ReplicaRequest]) -> dict[str, concurrent.futures.Future]:
    """Each request streamed on the loop; a future of all its outputs."""
    async def collect(r: ReplicaRequest) -> list[RequestOutput]:
        responses = submit(handle, r)
        try:
            return [output async for output in responses]
        finally:          # cancelled: the replica stops computing it, as the ingress's streams do
            responses.cancel()
    return {r.request_id: asyncio.run_coroutine_threadsafe(collect(r), loop) for r in requests}


def _running_replicas(app_name: str) -> int:
    deployment = serve.status().applications[app_name].deployments["EngineReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def _wait(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.25)


def _ran_to_the_end(streams: dict[str, concurrent.futures.Future], max_tokens: int) -> None:
    for request_id, stream in streams.items():
        outputs = stream.result(timeout=180)
        assert outputs and outputs[-1].finished and len(outputs[-1].token_ids) == max_tokens, (request_id, outputs[-1:])


LONG = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)


def _both_replicas_running() -> bool:
    """From the snapshots the replicas post, not from calls: Ray routes a call to the less loaded replica, so
    while one replica runs streams and the other none, every stats call would reach the idle one."""
    snapshots = ray.get(board(REPLICAS_APP).fresh.remote(1.0))
    return len(snapshots) == 2 and all(s.sequences_running for s in snapshots.values())


def test_a_removed_replica_finishes_its_requests_first(replicas, streams_loop):
    """The module's two replicas, updated to one (the last test of them): the one removed drains first."""
    prompts = random_prompts([6] * 8, seed=41)
    streams: dict[str, concurrent.futures.Future] = {}
    for i, prompt in enumerate(prompts):      # one by one until both replicas run some (routed by load)
        streams |= _stream_all(streams_loop, replicas, [request(f"drain-{i}", prompt, None, params=LONG)])
        time.sleep(0.3)
        if _both_replicas_running():
            break
    assert _both_replicas_running(), "the requests did not reach both replicas"
    serve.run(replica_app(EngineConfig(model=BASE_MODEL), 1, num_gpus=0, num_cpus=0.5, max_adapters=1024),
              name=REPLICAS_APP, route_prefix=None)
    _ran_to_the_end(streams, LONG.max_tokens)
    _wait(lambda: _running_replicas(REPLICAS_APP) == 1, "one replica left", 60)


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(cluster, streams_loop):
    name = "slora-autoscale"
    scaling = Autoscaling(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.5,
                          downscale_delay_s=2.0, look_back_period_s=1.0)
    handle = serve.run(replica_app(EngineConfig(model=BASE_MODEL), 1, num_gpus=0, num_cpus=0.1,
                                   autoscaling=scaling), name=name, route_prefix=None)
    try:
        assert _running_replicas(name) == 1
        prompts = random_prompts([6] * 4, seed=43)
        # Long enough to outlast the second replica's start (the load must hold until Ray has added it); then
        # the streams are cancelled, which ends the load at once.
        load = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
        streams = _stream_all(streams_loop, handle,
                              [request(f"scale-{i}", p, None, params=load) for i, p in enumerate(prompts)])
        _wait(lambda: _running_replicas(name) == 2, "a second replica under load", 60)
        assert not any(stream.done() for stream in streams.values()), "the load ended before the second replica"
        for stream in streams.values():
            stream.cancel()
        _wait(lambda: _running_replicas(name) == 1, "back to one replica once idle", 60)
        _wait(lambda: not replica_stats(handle, 1)[0].running, "the cancelled streams stopped", 30)
    finally:
        serve.delete(name)
