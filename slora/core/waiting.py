"""The waiting queue, in the order of a scheduling policy, and the policy's choice of whom to preempt.

- `fcfs`: arrival order; a preempted sequence goes back to the front. A request's priority is refused.
- `priority`: a request's `priority` (lower first, as vLLM's), then arrival.
- `vtc`: the waiting tenant with the smallest virtual token counter (slora.core.fair_share) first, and within
  a tenant its priority, then arrival. Priority never moves a tenant ahead of another's share.

The scheduler takes sequences with `pop`, gives back those it could not admit with `put_back`, and asks
`victim` which running sequence to preempt when pages run out.
"""
import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from slora.core.fair_share import FairShare, Tenant
from slora.core.sequence import Sequence

SCHEDULING_POLICIES = ("fcfs", "priority", "vtc")
_Entry = tuple[int, int, int, Sequence]        # (priority, arrival, seq_id, seq): seq_id is unique, seq never compared


class WaitingQueue(Protocol):
    def add(self, seq: Sequence) -> None:
        """A new sequence."""

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence."""

    def pop(self) -> Sequence:
        """The next sequence to admit (the queue is not empty)."""

    def put_back(self, seqs: list[Sequence]) -> None:
        """Sequences taken by `pop` and not admitted, in the order taken: they keep their places."""

    def remove(self, seq: Sequence) -> None: ...

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """Which of the running `candidates` (in admission order) to preempt first."""

    def __iter__(self) -> Iterator[Sequence]:
        """The waiting sequences, about in the order they will be admitted."""

    def __len__(self) -> int: ...

    def __contains__(self, seq: object) -> bool: ...


class FcfsQueue:
    """Arrival order; the newest running sequence is preempted first."""

    def __init__(self) -> None:
        self._seqs: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._seqs.append(seq)

    def requeue(self, seq: Sequence) -> None:
        self._seqs.appendleft(seq)

    def pop(self) -> Sequence:
        return self._seqs.popleft()

    def put_back(self, seqs: list[Sequence]) -> None:
        self._seqs.extendleft(reversed(seqs))

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs


class FairQueue:
    """One heap per tenant, by (priority, arrival); the tenant with the smallest counter goes first. With
    `by_tenant=False` every sequence counts as one tenant's: the `priority` policy."""

    def __init__(self, share: FairShare, by_tenant: bool = True) -> None:
        self._share, self._by_tenant = share, by_tenant
        self._heaps: dict[Tenant, list[_Entry]] = {}
        self._last_to_leave: Tenant = None     # whose counter lifts a tenant arriving at an empty queue
        self._size = 0

    def _tenant(self, seq: Sequence) -> Tenant:
        return seq.tenant if self._by_tenant else None

    def add(self, seq: Sequence) -> None:
        tenant = self._tenant(seq)
        if tenant not in self._heaps:
            self._share.lift(tenant, self._floor())
        self._push(tenant, seq)

    def requeue(self, seq: Sequence) -> None:
        """By its priority and arrival, as any other: usually ahead of its tenant's newer requests. Not lifted:
        a tenant whose sequence was preempted did not idle."""
        self._push(self._tenant(seq), seq)

    def _floor(self) -> float:
        """The smallest counter of the tenants waiting; with none waiting, the last one's to leave the queue."""
        if not self._heaps:
            return self._share.counter(self._last_to_leave)
        return min(self._share.counter(tenant) for tenant in self._heaps)

    def _push(self, tenant: Tenant, seq: Sequence) -> None:
        heapq.heappush(self._heaps.setdefault(tenant, []), (seq.priority, seq.arrival, seq.seq_id, seq))
        self._size += 1

    def pop(self) -> Sequence:
        tenant = min(self._heaps, key=lambda t: (self._share.counter(t), self._heaps[t][0][:3]))
        heap = self._heaps[tenant]
        seq = heapq.heappop(heap)[-1]
        self._size -= 1
        if not heap:
            del self._heaps[tenant]
            self._last_to_leave = tenant
        return seq

    def put_back(self, seqs: list[Sequence]) -> None:
        for seq in seqs:                      # no lift: they never left the queue as far as fairness goes
            self._push(self._tenant(seq), seq)

    def remove(self, seq: Sequence) -> None:
        tenant = self._tenant(seq)
        heap = self._heaps[tenant]
        heap.pop(next(i for i, entry in enumerate(heap) if entry[-1] is seq))
        heapq.heapify(heap)
        self._size -= 1
        if not heap:
            del self._heaps[tenant]

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The tenant with the largest counter gives first, its lowest-priority, newest sequence."""
        def cost(item: tuple[int, Sequence]) -> tuple[float, int, int]:
            position, seq = item
            return self._share.counter(self._tenant(seq)) if self._by_tenant else 0.0, seq.priority, position
        return max(enumerate(candidates), key=cost)[1]

    def __iter__(self) -> Iterator[Sequence]:
        """Each tenant's sequences in heap order, the tenants taken in turn from the smallest counter."""
        tenants = sorted(self._heaps, key=self._share.counter)
        streams = [_heap_in_order(self._heaps[tenant]) for tenant in tenants]
        while streams:
            for stream in list(streams):
                seq = next(stream, None)
                if seq is None:
                    streams.remove(stream)
                else:
                    yield seq

    def __len__(self) -> int:
        return self._size

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, Sequence):
            return False
        heap = self._heaps.get(self._tenant(seq), [])
        return any(entry[-1] is seq for entry in heap)


def _heap_in_order(heap: list[_Entry]) -> Iterator[Sequence]:
    """A heap's sequences in sorted order, lazily: k of them in O(k log k), never sorting the whole heap (the
    engine reads the first few of a long queue every step)."""
    frontier = [(heap[0], 0)] if heap else []
    while frontier:
        entry, index = heapq.heappop(frontier)
        yield entry[-1]
        for child in (2 * index + 1, 2 * index + 2):
            if child < len(heap):
                heapq.heappush(frontier, (heap[child], child))


def waiting_queue(policy: str, share: FairShare) -> WaitingQueue:
    if policy == "fcfs":
        return FcfsQueue()
    return FairQueue(share, by_tenant=policy == "vtc")
