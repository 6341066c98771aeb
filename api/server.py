"""`slora serve`: uvicorn with the app, graceful on SIGTERM (stop admitting, let in-flight requests finish
within the shutdown timeout, abort the rest, exit 0)."""
import logging
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from slora.api.app import create_app
from slora.api.settings import ServerSettings
from slora.config import EngineConfig
from slora.engine import Engine

logger = logging.getLogger(__name__)


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


def serve(settings: ServerSettings, engine_config: EngineConfig) -> int:
    """Run the server until SIGTERM or SIGINT; returns the exit status."""
    app = create_app(lambda: Engine(engine_config), settings)
    # The app aborts what still runs after shutdown_timeout_s (so clients get a proper 503 error event);
    # uvicorn's own timeout, which just cancels the connections' tasks, is only a backstop behind it.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 5, lifespan="on")
    server = _Server(config, lambda: app.state.ctx.engine.begin_drain(settings.shutdown_timeout_s))
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
