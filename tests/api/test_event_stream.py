"""EventStreamResponse notices a client that left while a backlog of events is being written."""
import asyncio

from slora.api.streaming import EventStreamResponse


def test_a_disconnect_stops_a_backlog_of_events_that_never_suspends():
    """Events already queued and a transport that never pauses: nothing in the pump suspends by itself, yet a
    client gone from the start must stop it within a few events rather than after all of them."""
    sent: list[dict] = []
    closed: list[bool] = []

    async def backlog():
        for i in range(10_000):
            yield f"data: {i}\n\n"

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    response = EventStreamResponse(backlog(), closed.append)
    asyncio.run(response({"type": "http"}, receive, send))
    assert closed == [True]
    assert len(sent) < 10
