"""`slora serve`: uvicorn with the app, graceful on SIGTERM (stop admitting, let in-flight requests finish
within the shutdown timeout, abort the rest, exit 0), on a socket bound before the model loads, with the
connection limits of ServerSettings: idle keep-alive, the time to send headers, pauses inside a body, and the
number of open connections."""
import asyncio
import functools
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from slora.api.app import create_app
from slora.api.settings import ServerSettings
from slora.config import EngineConfig
from slora.engine import Engine

logger = logging.getLogger(__name__)


class ListenError(ValueError):
    """The server cannot listen on the address it was given (taken, not permitted, unknown host)."""


class StartupError(ValueError):
    """The server stopped during its start: an adapter of --lora-modules could not be loaded."""


@dataclass(frozen=True)
class ReadTimeouts:
    header_s: float         # from a connection's start, or a new request's first byte, to the end of its headers
    body_idle_s: float      # the longest pause while a request body arrives


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines while a request is read. uvicorn 0.54 times a connection out only
    after a response (timeout_keep_alive), so one that sends nothing, sends its headers a byte at a time or
    stops inside a body stayed open for ever. The header deadline is not extended by bytes that trickle in;
    the body timer restarts with every chunk, and waits while the pause is the server's (reading paused until
    the app catches up, or a client waiting for 100 Continue)."""

    def __init__(self, *args: Any, timeouts: ReadTimeouts, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timeouts = timeouts
        self._read_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._expect_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE:                 # headers incomplete: the deadline set at their first byte holds
            if not self._awaiting_headers:
                self._expect_headers()
        elif state is h11.SEND_BODY:
            self._arm(self._timeouts.body_idle_s, self._body_paused)
        else:                                 # the request is in; the app (then keep-alive) takes over
            self._disarm()

    def _expect_headers(self) -> None:
        self._arm(self._timeouts.header_s, self._headers_late)
        self._awaiting_headers = True

    def _headers_late(self) -> None:
        logger.debug("closing a connection from %s: no complete request headers within %.1fs", self.client,
                     self._timeouts.header_s)
        self.transport.close()

    def _body_paused(self) -> None:
        if self.flow.read_paused or self.conn.they_are_waiting_for_100_continue:
            self._arm(self._timeouts.body_idle_s, self._body_paused)     # the pause is the server's
            return
        logger.debug("closing a connection from %s: its request body paused for %.1fs", self.client,
                     self._timeouts.body_idle_s)
        self.transport.close()

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._awaiting_headers = False


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app to stop admitting as soon as the signal arrives (uvicorn itself
    only stops accepting connections; requests on open keep-alive connections would still be admitted)."""

    def __init__(self, config: uvicorn.Config, on_exit_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit_signal = on_exit_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit_signal()
        super().handle_exit(sig, frame)


def _after_shutdown(sig: int, frame: FrameType | None) -> None:
    # uvicorn re-raises the signal it caught once it has shut down, so that the default handler kills the
    # process; the shutdown was graceful, so the exit status should be 0 instead.
    logger.info("shut down after signal %d", sig)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port. Bound before the model loads, so that a taken port is a clear error at
    once; uvicorn's own bind comes after the app's startup and aborts the process."""
    where = f"{host}:{port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET     # as uvicorn: a name means IPv4
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, family, socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {where}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: restarts need no wait
        sock.bind(address)
    except OSError as exc:
        sock.close()
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ListenError(f"cannot listen on {where}: {reason[:1].lower()}{reason[1:]}") from None
    return sock


def uvicorn_config(app: FastAPI, settings: ServerSettings) -> uvicorn.Config:
    timeouts = ReadTimeouts(settings.timeout_header_s, settings.timeout_body_idle_s)
    # The app aborts what still runs after shutdown_timeout_s (so clients get a proper 503 error event);
    # uvicorn's own timeout, which just cancels the connections' tasks, is only a backstop behind it.
    # uvicorn answers 503 once `limit_concurrency` connections are open, counting the one asking: one more
    # than max_connections, so that max_connections of them are served.
    return uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 5,
                          # uvicorn annotates these narrower than it takes them: the keep-alive timeout is a
                          # call_later delay (any float), and `http` any factory of protocols.
                          timeout_keep_alive=settings.timeout_keep_alive_s,  # type: ignore[arg-type]
                          limit_concurrency=settings.max_connections + 1,
                          http=functools.partial(ReadTimeoutH11Protocol, timeouts=timeouts))  # type: ignore[arg-type]


def serve(settings: ServerSettings, engine_config: EngineConfig) -> int:
    """Run the server until SIGTERM or SIGINT; returns the exit status. Raises ListenError, and StartupError
    when the start fails (a --lora-modules adapter refused), once the server has shut down."""
    with listen(settings.host, settings.port) as sock:
        app = create_app(lambda: Engine(engine_config), settings)
        ctx = app.state.ctx
        server = _Server(uvicorn_config(app, settings), lambda: ctx.engine.begin_drain(settings.shutdown_timeout_s))
        ctx.on_startup_failure = lambda: setattr(server, "should_exit", True)
        logger.info("listening on http://%s:%d", settings.host, sock.getsockname()[1])
        _run(server, sock)
    if ctx.startup_error is not None:
        raise StartupError(ctx.startup_error)
    return 0 if server.started else 1


def _run(server: uvicorn.Server, sock: socket.socket) -> None:
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
