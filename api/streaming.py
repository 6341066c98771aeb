"""Server-sent events that notice a client going away, and a way to run non-streamed work until either it
finishes or the client disconnects (both abort the engine request at once instead of generating for
nobody)."""
import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientGone if the client disconnects first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` from an async iterator of ready-made events. Whether the stream ends, the client
    disconnects or sending fails, the iterator is closed and `on_close(disconnected)` is called once."""

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[bool], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        disconnected = True
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            disconnected = not pump.done() or pump.cancelled() or pump.result() is False
        finally:
            for task in (pump, watcher):
                if not task.done():
                    task.cancel()
            await asyncio.gather(pump, watcher, return_exceptions=True)
            await self._events.aclose()
            self._on_close(disconnected)

    async def _pump(self, send: Send) -> bool:
        """Send every event; False if the connection turned out to be closed."""
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self._events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                # Neither a queued event nor a send into an unpaused transport suspends: without a yield here,
                # a backlog of events would hold the loop, and the disconnect watcher (and the transport's
                # connection_lost) would run only after every event of a finished request was written.
                await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:          # uvicorn raises ClientDisconnected (an OSError) on a closed connection
            return False
        return True
