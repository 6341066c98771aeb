"""ClusterEngine without Ray: a fake DeploymentHandle whose streams the tests script. The catalog is built from
the tiny model's config; requests resolve there, stream, abort, and fail alone when their stream breaks."""
import asyncio
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from slora.api.cluster_engine import ClusterEngine
from slora.api.replica import ReplicaRequest
from slora.config import EngineConfig
from slora.core.outputs import (
    INTERNAL_ERROR,
    AdapterName,
    AdapterPlacement,
    CompletionOutput,
    EngineSnapshot,
    RequestOutput,
)
from slora.execution.adapter_manager import UnknownAdapterError
from slora.sampling.params import SamplingParams

BASE_MODEL = "slora-tiny-llama"
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def output(request: ReplicaRequest, tokens: list[int], finished: bool) -> RequestOutput:
    sample = CompletionOutput(0, tokens, "", "length" if finished else None)
    return RequestOutput(request.request_id, request.prompt_token_ids, [sample], finished=finished)


class FakeStream:
    """What `handle.options(stream=True).remote(...)` returns: an async iterator that can be cancelled."""

    def __init__(self, script: Callable[[ReplicaRequest], list[RequestOutput | BaseException | float | Callable]],
                 request: ReplicaRequest) -> None:
        self.items = script(request)
        self.cancelled = False

    def __aiter__(self) -> "FakeStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while self.items:
            item = self.items.pop(0)
            if isinstance(item, float):         # a pause
                await asyncio.sleep(item)
                continue
            if isinstance(item, BaseException):
                raise item
            if callable(item):                  # something that happens as the next output arrives
                item()
                continue
            return item
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, script: Callable[[ReplicaRequest], list]) -> None:
        self.script = script
        self.sent: list[tuple[dict, ReplicaRequest]] = []
        self.streams: list[FakeStream] = []
        self._options: dict = {}

    def options(self, **options) -> "FakeHandle":
        self._options = options
        return self

    def remote(self, request: ReplicaRequest) -> FakeStream:
        self.sent.append((self._options, request))
        self.streams.append(FakeStream(self.script, request))
        return self.streams[-1]


def run_to_end(engine: ClusterEngine, timeout_s: float = 10.0) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "requests did not end"
        outputs += engine.step()
    return outputs


class FakeBoard:
    """The replicas' SnapshotBoard as the ingress uses it: `await board.fresh.remote(max_age_s)` and
    `board.abort.remote(request_id)`."""

    def __init__(self, snapshots: dict[str, EngineSnapshot]) -> None:
        self.snapshots = snapshots
        self.aborted: list[str] = []
        self.fresh = SimpleNamespace(remote=self._fresh)
        self.abort = SimpleNamespace(remote=self.aborted.append)

    async def _fresh(self, max_age_s: float) -> dict[str, EngineSnapshot]:
        return dict(self.snapshots)


def make(script: Callable[[ReplicaRequest], list], stall_timeout_s: float = 30.0, pool_pages: int = 4096,
         board: FakeBoard | None = None) -> tuple[ClusterEngine, FakeHandle]:
    handle = FakeHandle(script)
    engine = ClusterEngine(EngineConfig(model=BASE_MODEL), handle, pool_pages=pool_pages, board=board,
                           stall_timeout_s=stall_timeout_s)
    return engine, handle


def test_a_request_streams_its_replicas_outputs():
    board = FakeBoard({})
    engine, handle = make(lambda r: [output(r, [1], False), output(r, [1, 2], True)], board=board)
    engine.add_request("a", [5, 6, 7], PARAMS)
    outputs = run_to_end(engine)
    assert [o.token_ids for o in outputs] == [[1], [1, 2]] and outputs[-1].finished
    assert handle.sent[0][0] == {"stream": True, "method_name": "generate"}
    assert not handle.streams[0].cancelled and board.aborted == []      # it ended: nothing to stop


def test_an_adapter_is_routed_by_its_version_with_its_folder():
    engine, handle = make(lambda r: [output(r, [3], True)])
    name = next(entry.name for entry in engine.adapters.all_entries())      # a demo adapter of the tiny model
    version = engine.adapters.resolve(name, None).version
    engine.add_request("a", [5, 6], PARAMS, adapter=name)
    assert engine.adapters.versions[version].refs == 2          # its name, and the request until it ends
    run_to_end(engine)
    assert engine.adapters.versions[version].refs == 1
    options, request = handle.sent[0]
    assert options["multiplexed_model_id"] == version == request.adapter_version
    assert request.adapter_folder == str(engine.adapters.source_folder(version))


def test_unknown_adapters_and_bad_requests_are_refused_at_the_ingress():
    engine, handle = make(lambda r: [])
    with pytest.raises(UnknownAdapterError):
        engine.add_request("a", [5], PARAMS, adapter="nope", owner="alice")
    with pytest.raises(ValueError):
        engine.add_request("b", [10 ** 9], PARAMS)             # out of the vocabulary
    assert not handle.sent and not engine.has_unfinished()


def test_abort_cancels_the_stream_posts_it_to_the_board_and_returns_the_final_output():
    board = FakeBoard({})
    engine, handle = make(lambda r: [output(r, [1], False), 30.0, output(r, [1, 2], True)], board=board)
    engine.add_request("a", [5], PARAMS)
    while not engine.step():
        pass
    aborted = engine.abort("a")
    assert aborted is not None and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished()
    deadline = time.monotonic() + 5
    while not (handle.streams[0].cancelled and board.aborted):
        assert time.monotonic() < deadline, "the stream was not cancelled, or the board not told"
        time.sleep(0.01)
    assert board.aborted == ["a"]        # the replicas' second way to hear of it, should Ray's cancel be lost


def test_an_abort_that_arrives_with_an_output_still_stops_the_stream():
    """The abort lands while the next output is ready: asyncio.wait_for (Python < 3.12) returned the output and
    dropped the cancellation, and the stream, with its replica, ran on to its end."""
    board = FakeBoard({})
    added = threading.Event()

    def abort() -> None:          # on the streams' loop, as the next output is returned
        assert added.wait(5), "add_request did not return"
        engine.abort("a")
    engine, handle = make(lambda r: [output(r, [1], False), abort,
                                     *(output(r, [1] * k, False) for k in range(2, 200)), output(r, [1] * 200, True)],
                          board=board)
    engine.add_request("a", [5], PARAMS)
    added.set()
    deadline = time.monotonic() + 5
    while not (handle.streams and handle.streams[0].cancelled and board.aborted):
        assert time.monotonic() < deadline, "the aborted request's stream was neither cancelled nor stopped"
        time.sleep(0.01)
    assert len(handle.streams[0].items) > 150, "the stream was read on after its abort"
    assert not engine.has_unfinished()


@pytest.mark.parametrize("failure", ["error", "stall"])
def test_a_broken_stream_ends_its_request_with_an_error(failure):
    def script(r: ReplicaRequest) -> list:
        return [output(r, [1], False), RuntimeError("actor died") if failure == "error" else 30.0]
    board = FakeBoard({})
    engine, _ = make(script, stall_timeout_s=0.5, board=board)
    engine.add_request("a", [5], PARAMS)
    outputs = run_to_end(engine)
    final = outputs[-1]
    assert final.finished and final.error is not None and final.error.code == INTERNAL_ERROR
    assert final.token_ids == [1] and final.outputs[0].finish_reason == "error"
    assert board.aborted == ["a"]        # a stalled replica may still be computing it


def test_a_tenants_weight_travels_with_its_requests():
    engine, handle = make(lambda r: [output(r, [1], True)])
    engine.set_tenant_weight("alice", 3.0)
    with pytest.raises(ValueError):
        engine.set_tenant_weight("bob", 0.0)
    engine.add_request("a", [5], PARAMS, owner="alice")
    engine.add_request("b", [5], PARAMS, owner="bob")
    run_to_end(engine)
    assert [request.weight for _, request in handle.sent] == [3.0, None]


def test_the_catalog_keeps_no_packed_copies():
    engine, _ = make(lambda r: [])
    assert engine.adapters.versions and engine.adapters.host_bytes == 0


def test_a_prompt_too_long_for_a_replicas_pool_is_refused_at_the_ingress():
    engine, handle = make(lambda r: [output(r, [1], True)], pool_pages=8)     # 8 pages of 16 tokens
    with pytest.raises(ValueError, match="pages but the pool has only"):
        engine.add_request("long", list(range(5, 200)), PARAMS)
    engine.add_request("short", [5, 6, 7], PARAMS)
    run_to_end(engine)
    assert [request.request_id for _, request in handle.sent] == ["short"]


def replica_snapshot(placements: dict[str, AdapterPlacement], running: int) -> EngineSnapshot:
    return EngineSnapshot(pool={"total_pages": 64}, sequences_running=running, sequences_waiting=0, requests=running,
                          preemptions=0, adapter_pool_loads=1, adapter_pool_evictions=0, adapters_registered=1,
                          adapters_host=1, adapters_pool=1, steps={}, step_seconds={}, decode_bytes=0,
                          adapter_placements=placements)


def test_the_replicas_snapshots_come_with_the_catalogs_names():
    board = FakeBoard({})
    engine, _ = make(lambda r: [], board=board)
    name = next(entry.name for entry in engine.adapters.all_entries())      # a demo adapter of the tiny model
    version = engine.adapters.resolve(name, None).version
    # A replica knows each version by the version alone, as a public name of no owner.
    as_replica = AdapterPlacement(True, True, False, (AdapterName(version, None, True),), frozenset({None}))
    board.snapshots = {"r1": replica_snapshot({version: as_replica, "gone": as_replica}, running=2),
                       "r2": replica_snapshot({}, running=0)}
    deadline = time.monotonic() + 10
    while len(replicas := engine.snapshot().replicas) < 2:
        assert time.monotonic() < deadline, "the board was not read"
        time.sleep(0.05)
    placed = replicas["r1"].adapter_placements
    assert placed[version].names == (AdapterName(name, None, True),) and placed[version].in_pool
    assert placed["gone"].names == ()          # a version the catalog no longer names is shown under none
    assert replicas["r1"].sequences_running == 2 and replicas["r2"].sequences_running == 0
    board.snapshots = {"r2": board.snapshots["r2"]}          # r1 stopped posting: the board drops it
    while "r1" in engine.snapshot().replicas:
        assert time.monotonic() < deadline + 10, "a replica gone from the board stayed"
        time.sleep(0.05)


@pytest.mark.parametrize("flags, message", [
    (["--ray-address", "127.0.0.1:6379"], "--ray-address needs --replicas"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--replica-gpus", "-1"], "must be >= 0"),
    (["--autoscale-min", "1", "--autoscale-max", "2"], "--autoscale-min needs --replicas"),
    (["--replicas", "2", "--autoscale-min", "1"], "needs both --autoscale-min and --autoscale-max"),
    (["--replicas", "2", "--autoscale-min", "3", "--autoscale-max", "2"], "0 <= min <= max"),
    (["--replicas", "2", "--autoscale-target", "4"], "--autoscale-target needs --autoscale-min"),
    (["--replicas", "2", "--autoscale-min", "1", "--autoscale-max", "2", "--autoscale-target", "0"],
     "target must be positive"),
    (["--replicas", "2", "--replica-drain-timeout", "0"], "--replica-drain-timeout must be positive"),
])
def test_replica_flags_are_checked_before_anything_starts(flags, message, capsys):
    from slora.cli import main
    assert main(["serve", "--model", BASE_MODEL, "--port", "1", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_single_server_never_imports_ray():
    """Without --replicas the app, its engine and the CLI run without Ray (not even imported)."""
    import subprocess
    import sys
    code = ("import sys\n"
            "from slora.api.app import create_app\nfrom slora.api.settings import ServerSettings\n"
            "from slora.cli import main\nfrom slora.config import EngineConfig\nfrom slora.engine import Engine\n"
            f"create_app(Engine(EngineConfig(model={BASE_MODEL!r})), ServerSettings())\n"
            "print('ray' in sys.modules, 'ray.serve' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]
