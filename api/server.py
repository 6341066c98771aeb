"""`slora serve`: uvicorn with the app, graceful on SIGTERM (stop admitting, let in-flight requests finish
within the shutdown timeout, abort the rest, exit 0), on a socket bound before the model loads, with the
connection limits of ServerSettings (api/connections.py): idle keep-alive, the time to send a request head,
pauses and the rate inside a body, requests in progress (with a reserve for /health and keyed requests), and
idle connections per client address and in all."""
import functools
import logging
import os
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from slora.api.app import create_app
from slora.api.connections import ConnectionGate, ConnectionLimits, GuardedH11Protocol, ReadLimits, privileged_requests
from slora.api.settings import ServerSettings
from slora.config import EngineConfig
from slora.engine import Engine

if TYPE_CHECKING:
    from slora.api.cluster import ClusterOptions

logger = logging.getLogger(__name__)


class ListenError(ValueError):
    """The server cannot listen on the address it was given (taken, not permitted, unknown host)."""


class StartupError(ValueError):
    """The server stopped during its start: an adapter of --lora-modules could not be loaded."""


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


def connection_gate(app: FastAPI, settings: ServerSettings) -> ConnectionGate:
    """The connection accounting of one server: its keyed requests are those of the app's tenants."""
    ctx = app.state.ctx
    limits = ConnectionLimits(max_active=settings.max_connections, reserve=settings.reserved_connections,
                              per_client=settings.max_connections_per_client, max_idle=settings.max_connections,
                              retry_after_s=settings.retry_after_s, max_discard=settings.max_body_bytes)
    return ConnectionGate(limits, privileged_requests(ctx.tenants), ctx.count_error)


def uvicorn_config(app: FastAPI, settings: ServerSettings) -> uvicorn.Config:
    read_limits = ReadLimits(settings.timeout_header_s, settings.timeout_body_idle_s, settings.min_body_rate)
    protocol = functools.partial(GuardedH11Protocol, limits=read_limits, gate=connection_gate(app, settings))
    # The app aborts what still runs after shutdown_timeout_s (so clients get a proper 503 error event);
    # uvicorn's own timeout, which just cancels the connections' tasks, is only a backstop behind it.
    # No WebSocket: an upgraded connection would leave the protocol, and with it the gate's accounting.
    return uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", ws="none",
                          timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 5,
                          # uvicorn annotates these narrower than it takes them: the keep-alive timeout is a
                          # call_later delay (any float), and `http` any factory of protocols.
                          timeout_keep_alive=settings.timeout_keep_alive_s,  # type: ignore[arg-type]
                          http=protocol)  # type: ignore[arg-type]


def serve(settings: ServerSettings, engine_config: EngineConfig, cluster: "ClusterOptions | None" = None) -> int:
    """Run the server until SIGTERM or SIGINT; returns the exit status. Raises ListenError, StoreError (the
    adapter store is another server's), and StartupError when the start fails (a --lora-modules adapter
    refused), once the server has shut down. With `cluster`, the engines are replicas on Ray Serve."""
    with listen(settings.host, settings.port) as sock:
        if cluster is None:
            return _serve(sock, create_app(lambda: Engine(engine_config), settings), settings)
        from slora.api.cluster import cluster_app, undeploy
        try:
            return _serve(sock, cluster_app(engine_config, settings, cluster), settings)
        finally:
            undeploy(cluster)


def _serve(sock: socket.socket, app: FastAPI, settings: ServerSettings) -> int:
    """Serve `app` on the bound socket until a signal (see `serve`)."""
    ctx = app.state.ctx
    ctx.open_store()        # held by another server: a one-line error (StoreError) before the model loads
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
