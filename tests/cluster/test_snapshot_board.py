"""SnapshotBoard without Ray: the plain class the replicas post to. Besides their snapshots it carries the ids of
requests the ingress aborted, each to every replica once, in the answer to that replica's next post."""
from types import SimpleNamespace

import pytest

from slora.api import replica
from slora.api.replica import ABORTED_KEPT_S, SnapshotBoard
from slora.core.outputs import EngineSnapshot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(replica, "time", SimpleNamespace(monotonic=clock.monotonic))   # the module's clock only
    return clock


SNAPSHOT = EngineSnapshot(pool={}, sequences_running=0, sequences_waiting=0, requests=0, preemptions=0,
                          adapter_pool_loads=0, adapter_pool_evictions=0, adapters_registered=0, adapters_host=0,
                          adapters_pool=0, steps={}, step_seconds={}, decode_bytes=0, taken_at=0.0)


def test_each_replica_hears_of_an_abort_once_at_its_next_post(clock):
    board = SnapshotBoard()
    assert board.post("r1", SNAPSHOT) == []
    clock.now += 0.5
    board.abort("a")
    clock.now += 0.5
    assert board.post("r1", SNAPSHOT) == ["a"]
    assert board.post("r2", SNAPSHOT) == ["a"]          # a replica's first post: every id still kept
    clock.now += 1.0
    board.abort("b")
    clock.now += 1.0
    assert board.post("r1", SNAPSHOT) == ["b"]
    assert board.post("r2", SNAPSHOT) == ["b"]
    assert set(board.fresh(max_age_s=5.0)) == {"r1", "r2"}


def test_an_abort_is_forgotten_after_it_was_kept_long_enough(clock):
    """The board's memory is bounded: a replica silent for longer no longer hears of older aborts."""
    board = SnapshotBoard()
    board.post("slow", SNAPSHOT)
    clock.now += 1.0
    board.abort("old")
    clock.now += ABORTED_KEPT_S + 1
    board.abort("new")
    assert board.post("slow", SNAPSHOT) == ["new"]
