"""Connections of `slora serve`: how many are served, who may hold them, and how long a request may take to
arrive. One `ConnectionGate` per server is shared by all its connections (`GuardedH11Protocol`, uvicorn's h11
protocol with these limits); everything runs on the event loop thread, so plain counters need no lock.

- A connection without a request in progress (new, or an idle keep-alive one between requests) is *idle*. Idle
  connections count against their client address only (`per_client` of them; beyond, that address's oldest
  idle connection is closed) and against a global bound (`max_idle`; beyond, the oldest idle connection of the
  address holding the most idle connections is closed). A new connection is never refused for being idle: a
  client sends its request head within milliseconds of connecting, so under a flood it is the newest, and
  the attacker's addresses hold more idle connections than it does.
- A connection with a request in progress is *active*; `max_active` of them are served. The last `reserve`
  slots go only to /health and keyed requests (a valid tenant key, or any request in single-user mode); any
  other request is answered 503 once `max_active - reserve` are in progress. Over-cap answers are the JSON
  error object with Retry-After and `Connection: close`.
- A request head must arrive within `header_s` of the connection's start or of the request's first byte; a
  body may pause for at most `body_idle_s`, and must arrive at `min_body_rate` bytes/s or faster, measured
  over windows of `body_idle_s` from its start, while the server is ready to read (a 408 error, then close).
"""
import asyncio
import http
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import h11
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from slora.api.app import answer_unread, authenticate, discard_body
from slora.api.errors import APIError
from slora.api.tenants import TenantDirectory

logger = logging.getLogger(__name__)
HEALTH_ROUTE = "/health"


class Idle(Protocol):
    """What the gate needs of a connection: its client address, and a way to close it."""

    peer: str

    def evict(self) -> None: ...


@dataclass(frozen=True)
class ConnectionLimits:
    max_active: int           # requests in progress, whole server
    reserve: int              # of max_active, kept for /health and keyed requests
    per_client: int           # idle connections of one client address
    max_idle: int             # idle connections of all addresses
    retry_after_s: int        # what Retry-After says on a 503
    max_discard: int          # body bytes read and dropped before a refusal is answered (see discard_body)

    def __post_init__(self) -> None:
        assert 0 <= self.reserve < self.max_active, self
        assert self.per_client >= 1 and self.max_idle >= 1, self


@dataclass(frozen=True)
class ReadLimits:
    header_s: float           # from a connection's start, or a new request's first byte, to the end of its head
    body_idle_s: float        # the longest pause inside a body; also the body rate's grace and window
    min_body_rate: float      # bytes/s a body must keep up, measured per window; 0: not checked


def overloaded(retry_after_s: int) -> APIError:
    return APIError(503, "the server has too many requests in progress; retry later", code="server_overloaded",
                    headers={"Retry-After": str(retry_after_s)})


def request_timeout(message: str) -> APIError:
    return APIError(408, message, code="request_timeout", error_type="invalid_request_error")


def privileged_requests(tenants: TenantDirectory) -> Callable[[Scope], bool]:
    """Which requests may use the reserve: /health, and those with a valid key (every request in single-user
    mode, where TenantDirectory.authenticate accepts any key)."""
    def privileged(scope: Scope) -> bool:
        if scope.get("path") == HEALTH_ROUTE:
            return True
        try:
            authenticate(tenants, Headers(scope=scope))
        except APIError:
            return False
        return True
    return privileged


class ConnectionGate:
    """The idle and active connections of one server (see the module's docstring)."""

    def __init__(self, limits: ConnectionLimits, privileged: Callable[[Scope], bool],
                 on_error: Callable[[int], None]) -> None:
        self.limits = limits
        self.privileged = privileged
        self.on_error = on_error
        self.active = 0
        self.evicted = 0                                      # idle connections closed to make room
        self._idle: dict[str, dict[Idle, None]] = {}          # per address, oldest first
        self._by_count: dict[int, dict[str, None]] = {}       # addresses by their number of idle connections
        self._top = 0                                         # no address has more idle connections than this
        self._idle_total = 0

    @property
    def idle_count(self) -> int:
        return self._idle_total

    def idle(self, conn: Idle) -> None:
        """`conn` has no request in progress from now on: the newest idle connection of its address. Makes
        room beyond the per-address and the global bound by closing older idle connections."""
        self.busy(conn)
        mine = self._idle.setdefault(conn.peer, {})
        self._recount(conn.peer, len(mine), len(mine) + 1)
        mine[conn] = None
        self._idle_total += 1
        if len(mine) > self.limits.per_client:
            self._evict(next(iter(mine)))
        if self._idle_total > self.limits.max_idle:
            self._evict(self._victim())

    def busy(self, conn: Idle) -> None:
        """`conn` has a request in progress, or is gone: no longer idle."""
        mine = self._idle.get(conn.peer)
        if mine is None or conn not in mine:
            return
        del mine[conn]
        self._idle_total -= 1
        self._recount(conn.peer, len(mine) + 1, len(mine))
        if not mine:
            del self._idle[conn.peer]

    def _recount(self, peer: str, old: int, new: int) -> None:
        if old:
            bucket = self._by_count[old]
            del bucket[peer]
            if not bucket:
                del self._by_count[old]
        if new:
            self._by_count.setdefault(new, {})[peer] = None
            self._top = max(self._top, new)

    def _victim(self) -> Idle:
        """The oldest idle connection of the address with the most of them: a flood from many addresses
        churns its own connections, however fast it reconnects, before it reaches a client with one."""
        while self._top not in self._by_count:
            self._top -= 1
        peer = next(iter(self._by_count[self._top]))
        return next(iter(self._idle[peer]))

    def _evict(self, conn: Idle) -> None:
        self.busy(conn)
        self.evicted += 1
        logger.debug("closing an idle connection from %s to make room", conn.peer)
        conn.evict()

    def admit(self, scope: Scope) -> bool:
        """Take an active slot for this request, if one is free to it."""
        if self.active >= self.limits.max_active - self.limits.reserve:
            if self.active >= self.limits.max_active or not self.privileged(scope):
                return False
        self.active += 1
        return True

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Run one request in an active slot, or answer 503 without reading its body."""
        if not self.admit(scope):
            await discard_body(receive, Headers(scope=scope), self.limits.max_discard)
            await answer_unread(overloaded(self.limits.retry_after_s), self.on_error, scope, receive, send)
            return
        try:
            await app(scope, receive, send)
        finally:
            self.active -= 1


class _WatchedFlow(FlowControl):
    """uvicorn's flow control, telling the protocol when the server stops reading (its buffer is full until
    the app reads on): a body's rate is the client's only while the server reads."""

    def __init__(self, transport: asyncio.Transport, on_pause: Callable[[], None]) -> None:
        super().__init__(transport)
        self._on_pause = on_pause

    def pause_reading(self) -> None:
        super().pause_reading()
        self._on_pause()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the gate's accounting and deadlines while a request is read. uvicorn
    times a connection out only after a response (timeout_keep_alive), so one that sends nothing, sends its
    head a byte at a time or drips its body stayed open for ever. The head's deadline is not extended by bytes
    that trickle in; the body's idle timer restarts with every chunk and its rate is checked per window, both
    waiting while the pause is the server's (reading paused until the app catches up, or a client waiting for
    100 Continue). uvicorn's own cap (limit_concurrency) answers text/plain and counts idle connections, so it
    is not used: the gate runs each request instead."""

    def __init__(self, *args: Any, limits: ReadLimits, gate: ConnectionGate, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._gate = gate
        self._inner_app = self.app
        self.app = self._run_request
        self.peer = ""
        self._read_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = False
        self._seen_cycle: object = None
        self._rate_timer: asyncio.TimerHandle | None = None
        self._window_start = 0.0
        self._window_bytes = 0
        self._server_paused = False

    # ---- uvicorn's protocol interface ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _WatchedFlow(transport, self._reading_paused)
        self.peer = self.client[0] if self.client else ""
        self._expect_headers()
        self._gate.idle(self)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.SEND_BODY:
            self._window_bytes += len(data)
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._new_request():     # a pipelined request began
            self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._gate.busy(self)
        self._disarm()
        self._stop_rate()
        super().connection_lost(exc)

    def evict(self) -> None:
        self.transport.close()

    # ---- the gate ----------------------------------------------------------------------------------------------
    async def _run_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._gate.run(self._inner_app, scope, receive, send)
        finally:
            if self.scope is scope and not self.transport.is_closing():     # no later request has begun
                self._gate.idle(self)

    def _new_request(self) -> bool:
        """Whether uvicorn began a request (it makes one cycle per request head) since the last look."""
        if self.cycle is None or self.cycle is self._seen_cycle:
            return False
        self._seen_cycle = self.cycle
        self._gate.busy(self)
        return True

    # ---- deadlines -----------------------------------------------------------------------------------------
    def _follow_request(self) -> None:
        self._new_request()
        state = self.conn.their_state
        if state is h11.IDLE:                 # head incomplete: the deadline set at its first byte holds
            if not self._awaiting_headers:
                self._expect_headers()
        elif state is h11.SEND_BODY:
            self._arm(self._limits.body_idle_s, self._body_paused)
            if self._rate_timer is None and self._limits.min_body_rate > 0:
                self._start_rate_window()
            return
        else:                                 # the request is in; the app (then keep-alive) takes over
            self._disarm()
        self._stop_rate()

    def _expect_headers(self) -> None:
        self._arm(self._limits.header_s, self._headers_late)
        self._awaiting_headers = True

    def _headers_late(self) -> None:
        logger.debug("closing a connection from %s: no complete request head within %.1fs", self.peer,
                     self._limits.header_s)
        self.transport.close()

    def _body_paused(self) -> None:
        if self._server_pausing():
            self._arm(self._limits.body_idle_s, self._body_paused)
            return
        self._cut_off(f"the request body paused for more than {self._limits.body_idle_s:g} s")

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._awaiting_headers = False

    # ---- the body's rate -------------------------------------------------------------------------------------
    def _start_rate_window(self) -> None:
        self._window_start = self.loop.time()
        self._window_bytes = 0
        self._server_paused = False
        self._rate_timer = self.loop.call_later(self._limits.body_idle_s, self._check_rate)

    def _stop_rate(self) -> None:
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None

    def _reading_paused(self) -> None:
        self._server_paused = True

    def _server_pausing(self) -> bool:
        return self.flow.read_paused or self.conn.they_are_waiting_for_100_continue

    def _check_rate(self) -> None:
        self._rate_timer = None
        if self.conn.their_state is not h11.SEND_BODY:
            return
        rate = self._window_bytes / max(self.loop.time() - self._window_start, 1e-9)
        if rate < self._limits.min_body_rate and not (self._server_paused or self._server_pausing()):
            self._cut_off(f"the request body arrived at {rate:.0f} bytes/s, slower than the minimum of "
                          f"{self._limits.min_body_rate:g} bytes/s")
            return
        self._start_rate_window()

    def _cut_off(self, reason: str) -> None:
        """Answer 408 if no answer has begun, then close."""
        logger.debug("closing a connection from %s: %s", self.peer, reason)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
            # The app may still be waiting for the body: marked disconnected, its receive() now ends and its
            # send() writes nothing after this answer.
            cycle.disconnected = True
            cycle.message_event.set()
            self._gate.on_error(408)
            self.transport.write(_error_bytes(self.conn, request_timeout(reason)))
        self._disarm()
        self._stop_rate()
        self.transport.close()


def _error_bytes(conn: h11.Connection, error: APIError) -> bytes:
    """An error answer written straight to the connection, outside any app, ending with `Connection: close`."""
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
    reason = http.HTTPStatus(error.status).phrase.encode()
    events = (h11.Response(status_code=error.status, headers=headers, reason=reason), h11.Data(data=body),
              h11.EndOfMessage())
    return b"".join(conn.send(event) or b"" for event in events)

