"""Admission: per-tenant concurrent sequences with a bounded queue, per-tenant tokens per minute, and a bound
on the whole server's backlog.

Everything here runs on the event loop thread, so plain counters need no lock.
"""
import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

from slora.api.errors import bad_request, rate_limited
from slora.api.tenants import Tenant


@dataclass(eq=False)                             # compared by identity: two waiters may ask the same seats
class _Waiter:
    seats: int
    granted: asyncio.Future[None]


@dataclass
class _TenantSlots:
    active: int = 0                              # seats (sequences) of its requests in the engine
    waiters: deque[_Waiter] = field(default_factory=deque)

    def queued_seats(self) -> int:
        """Seats of those still waiting: a cancelled waiter stays in the queue until its task runs again."""
        return sum(w.seats for w in self.waiters if not w.granted.done())


def _fits(tenant: Tenant, slots: _TenantSlots, seats: int) -> bool:
    return tenant.max_concurrent is None or slots.active + seats <= tenant.max_concurrent


@dataclass
class TokenBucket:
    """A tenant's tokens per minute: full at first, refilled continuously at `capacity` per minute."""

    capacity: float
    tokens: float
    updated: float                               # time.monotonic() of the last refill

    def take(self, cost: int, now: float) -> float | None:
        """Take `cost` tokens: None if they were there, else the seconds until they will be."""
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.capacity / 60)
        self.updated = now
        if cost <= self.tokens:
            self.tokens -= cost
            return None
        return (cost - self.tokens) * 60 / self.capacity


class Admission:
    """`acquire` seats before a request enters the engine and `release` them when the request ends. A seat is
    one sequence in the engine's batch (a request holds prompts × samples of them), so a tenant's
    `max_concurrent` bounds its share of the batch, whatever the shape of its requests. A request whose seats
    are not free waits in the tenant's FIFO queue of at most `max_queued` seats; beyond that, 429. The
    server-wide `max_pending` counts requests, running or queued."""

    def __init__(self, max_pending: int, retry_after_s: int) -> None:
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self.pending = 0                         # active + queued, whole server
        self._slots: dict[str, _TenantSlots] = {}
        self._buckets: dict[str, TokenBucket] = {}   # one per tenant with a token rate (tenants are few)

    @property
    def queued(self) -> int:
        return sum(len(s.waiters) for s in self._slots.values())

    def charge_tokens(self, tenant: Tenant, cost: int) -> None:
        """Count a request's tokens (prompt tokens + max_tokens for every sample, reserved up front like
        OpenAI's limits) against the tenant's tokens per minute; 429 with the wait when they are not there."""
        limit = tenant.max_tokens_per_minute
        if limit is None:
            return
        if cost > limit:       # can never fit: a 400, which clients do not retry
            raise bad_request(f"Request too large for this API key's token rate limit: it needs {cost} tokens "
                              f"(prompt + max_tokens for every sample) and the limit is {limit} per minute; "
                              "lower max_tokens or n.", param="max_tokens", code="request_too_large")
        now = time.monotonic()
        bucket = self._buckets.setdefault(tenant.id, TokenBucket(limit, limit, now))
        wait = bucket.take(cost, now)
        if wait is not None:
            raise rate_limited(f"Token rate limit of this API key reached ({limit} tokens per minute); retry in "
                               f"{math.ceil(wait)} s.", math.ceil(wait))

    def settle_tokens(self, tenant: Tenant, reserved: int, used: int) -> None:
        """A request that was charged `reserved` at admission used `used`: give back the rest, or charge the
        excess (the balance may go below zero; later requests then wait for the refill)."""
        bucket = self._buckets.get(tenant.id)
        if bucket is not None:
            bucket.tokens = min(bucket.capacity, bucket.tokens + reserved - used)

    async def acquire(self, tenant: Tenant, seats: int) -> None:
        """Hold `seats` of the tenant's max_concurrent (a request's sequences: prompts × samples) until `release`:
        at once if they are free and nobody of the tenant queues ahead, else in its FIFO queue."""
        assert seats >= 1, seats
        _refuse_oversized(tenant, seats)
        if self.pending >= self.max_pending:
            raise rate_limited("The server is at capacity; retry later.", self.retry_after_s)
        slots = self._slots.setdefault(tenant.id, _TenantSlots())
        queued = slots.queued_seats()
        if not queued and _fits(tenant, slots, seats):
            slots.active += seats
            self.pending += 1
            return
        if queued + seats > tenant.max_queued:
            raise rate_limited(f"Too many concurrent sequences for this API key (limit {tenant.max_concurrent} "
                               f"sequences running, {tenant.max_queued} queued); retry later.", self.retry_after_s)
        await self._wait_for_slot(tenant, slots, seats)

    async def _wait_for_slot(self, tenant: Tenant, slots: _TenantSlots, seats: int) -> None:
        waiter = _Waiter(seats, asyncio.get_running_loop().create_future())
        slots.waiters.append(waiter)
        self.pending += 1
        try:
            await waiter.granted
        except asyncio.CancelledError:
            self._leave_queue(tenant, slots, waiter)
            raise

    def _leave_queue(self, tenant: Tenant, slots: _TenantSlots, waiter: _Waiter) -> None:
        """A waiter's request was cancelled (its client went away)."""
        if waiter.granted.done() and not waiter.granted.cancelled():
            self.release(tenant, waiter.seats)  # the seats were handed over just as it was cancelled
            return
        if waiter in slots.waiters:             # _grant may have dropped it already
            slots.waiters.remove(waiter)
        self.pending -= 1
        self._grant(tenant, slots)              # a big waiter gone: smaller ones behind it may fit now
        self._forget_if_idle(tenant.id, slots)

    def release(self, tenant: Tenant, seats: int) -> None:
        """Give back the `seats` a request held, and hand them to the oldest waiters that fit."""
        slots = self._slots[tenant.id]
        slots.active -= seats
        self.pending -= 1
        assert slots.active >= 0, (tenant.id, slots.active)
        self._grant(tenant, slots)
        self._forget_if_idle(tenant.id, slots)

    def _grant(self, tenant: Tenant, slots: _TenantSlots) -> None:
        """Admit waiters in arrival order while their seats fit; the first that does not fit stops the rest, so
        a small request never overtakes a big one (which would otherwise wait for ever)."""
        while slots.waiters:
            head = slots.waiters[0]
            if not head.granted.done() and not _fits(tenant, slots, head.seats):
                return
            slots.waiters.popleft()
            if not head.granted.done():         # a cancelled one just leaves; its task fixes `pending`
                slots.active += head.seats      # it is already counted in `pending`
                head.granted.set_result(None)

    def _forget_if_idle(self, tenant_id: str, slots: _TenantSlots) -> None:
        # `is`: a late cancelled waiter must not drop the entry a newer request of the tenant made
        if slots.active == 0 and not slots.waiters and self._slots.get(tenant_id) is slots:
            del self._slots[tenant_id]


def _refuse_oversized(tenant: Tenant, seats: int) -> None:
    """A 400, which clients do not retry, for a request that could never run: more sequences than the tenant
    may run at once."""
    limit = tenant.max_concurrent
    if limit is not None and seats > limit:
        raise bad_request(f"Request too large for this API key's concurrency limit: it needs {seats} sequences "
                          f"(prompts × samples per prompt) and this API key may run at most {limit} at once; "
                          "send fewer prompts or a lower n.", param="n", code="request_too_large")
