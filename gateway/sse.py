"""Server-sent events: an ASGI response that streams events and notices a vanished client.

Starlette's StreamingResponse only learns of a closed connection when a
write fails; a stream waiting on a long prefill would keep its engine request
(and its KV blocks) until then. This response watches the connection itself
and cancels the event source at once, whose ``finally`` aborts the requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"

_encoder = msgspec.json.Encoder()


def event(payload) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def named_event(name: str, payload) -> bytes:
    """An event with an ``event:`` line, as Anthropic's and the Responses API's streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


async def wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work, receive) -> bool:
    """Run the coroutine ``work`` until it ends or the client hangs up (ASGI ``receive`` sees the
    disconnect), whichever comes first; False if the client went first (``work`` is cancelled).
    ``work``'s own exception is raised."""
    task = asyncio.create_task(work)
    gone = asyncio.create_task(wait_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()
    return True


class SSEResponse:
    """``on_close`` runs when the response ends however it ends, also when the client left
    before the first event (an async generator closed unstarted never runs its ``finally``)."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_close: Callable[[], None] | None = None):
        self.events = events
        self.on_close = on_close
        self.headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
        ]

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.create_task(pump())
        watch_task = asyncio.create_task(wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_task, watch_task):
                t.cancel()
            await asyncio.gather(pump_task, watch_task, return_exceptions=True)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                self.on_close()
        if pump_task.done() and not pump_task.cancelled():
            exc = pump_task.exception()
            # A write to a connection that just closed is the client's leaving, not an error.
            if exc is not None and not isinstance(exc, OSError):
                raise exc
