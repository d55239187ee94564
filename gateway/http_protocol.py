"""uvicorn's HTTP/1.1 protocol with a deadline on the request head.

uvicorn times out a keep-alive connection only while it is silent, and a new
connection never: a client that sends half a request line, or one header a
minute, holds its connection (and a file descriptor) for ever. Here every
connection that is waiting for a request head (a new one, or a kept-alive
one after its last response) must complete the head within
``request_timeout`` seconds, or it is closed. The body has its own idle
deadline (gateway.request_body).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadDeadlineProtocol(H11Protocol):
    request_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.request_timeout, self._head_deadline_passed)

    def _cancel_head_deadline(self) -> None:
        timer = getattr(self, "_head_deadline", None)
        if timer is not None:
            timer.cancel()
            self._head_deadline = None

    def _head_deadline_passed(self) -> None:
        self._head_deadline = None
        # Until a whole head has arrived h11 keeps the client in IDLE; after it, the request runs.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol_with_deadline(request_timeout: float) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn's ``http=``, with this deadline."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"request_timeout": request_timeout})
