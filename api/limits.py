"""Admission: per-tenant concurrency with a bounded queue, per-tenant tokens per minute, and a bound on the
whole server's backlog.

Everything here runs on the event loop thread, so plain counters need no lock.
"""
import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

from slora.api.errors import bad_request, rate_limited
from slora.api.tenants import Tenant


@dataclass
class _TenantSlots:
    active: int = 0
    waiters: deque[asyncio.Future] = field(default_factory=deque)


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
    """`acquire` a slot before a request enters the engine and `release` it when the request ends.
    A tenant at `max_concurrent` waits in a FIFO queue of `max_queued`; beyond that, 429."""

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

    async def acquire(self, tenant: Tenant) -> None:
        if self.pending >= self.max_pending:
            raise rate_limited("The server is at capacity; retry later.", self.retry_after_s)
        slots = self._slots.setdefault(tenant.id, _TenantSlots())
        if tenant.max_concurrent is None or (slots.active < tenant.max_concurrent and not slots.waiters):
            slots.active += 1
            self.pending += 1
            return
        if len(slots.waiters) >= tenant.max_queued:
            raise rate_limited(f"Too many concurrent requests for this API key (limit {tenant.max_concurrent}"
                               f" running, {tenant.max_queued} queued); retry later.", self.retry_after_s)
        await self._wait_for_slot(tenant, slots)

    async def _wait_for_slot(self, tenant: Tenant, slots: _TenantSlots) -> None:
        waiter = asyncio.get_running_loop().create_future()
        slots.waiters.append(waiter)
        self.pending += 1
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(tenant)            # a slot was handed over just as we were cancelled
            else:                               # leave the queue; release() skips cancelled waiters
                if waiter in slots.waiters:
                    slots.waiters.remove(waiter)
                self.pending -= 1
                self._forget_if_idle(tenant.id, slots)
            raise

    def release(self, tenant: Tenant) -> None:
        slots = self._slots[tenant.id]
        slots.active -= 1
        self.pending -= 1
        while slots.waiters:                     # hand the slot to the oldest waiter still waiting
            waiter = slots.waiters.popleft()
            if not waiter.done():
                slots.active += 1               # it is already counted in `pending`
                waiter.set_result(None)
                break
        self._forget_if_idle(tenant.id, slots)

    def _forget_if_idle(self, tenant_id: str, slots: _TenantSlots) -> None:
        if slots.active == 0 and not slots.waiters:
            self._slots.pop(tenant_id, None)
