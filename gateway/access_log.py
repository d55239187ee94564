"""One access line per HTTP request, under vLLM's ``--enable-log-requests`` (off by default, as in vLLM).

The line is written when the response has been sent: request id(s), app, method and route,
status, prompt/cached/generated tokens, time to first token and duration. The ASGI wrapper
opens a record for each request in a context variable; the engine client's ``add`` (called in
that request's context, also from a streaming body's task, which inherits it) hands each engine
request's output queue to ``tap``, so the counts come from what the engine sent, whatever the route.
"""

from __future__ import annotations

import contextvars
import logging
import time

from mlxd.shared.protocol import RequestOutput

log = logging.getLogger("mlxd.access")

# Prometheus scrapes these every few seconds: their lines go to DEBUG, not between the requests'.
SCRAPED_PATHS = ("/metrics",)

_current: contextvars.ContextVar["_Record | None"] = contextvars.ContextVar("mlxd_access_record", default=None)


class _Record:
    __slots__ = ("start", "ids", "app", "prompt", "cached", "generated", "first_token", "status")

    def __init__(self, start: float):
        self.start = start
        self.ids: list[str] = []
        self.app: str | None = None
        # request id -> (prompt tokens, of which cached): several choices (n > 1) share a request line.
        self.prompt: dict[str, tuple[int, int]] = {}
        self.generated = 0
        self.first_token: float | None = None
        self.status: int | None = None

    def line(self, method: str, path: str, now: float) -> str:
        # Engine request ids are "<base>-<choice>"; the base is what the response's id carries
        # (chatcmpl-<base>, cmpl-<base>, ...), so a client's id finds its line.
        ids = sorted({i.rpartition("-")[0] or i for i in self.ids})
        ids = ",".join(ids) if ids else "-"
        ttft = f"{self.first_token - self.start:.3f}s" if self.first_token is not None else "-"
        return (f"{ids} app={self.app or '-'} {method} {path} {self.status or '-'} "
                f"prompt_tokens={sum(p for p, _ in self.prompt.values())} "
                f"cached_tokens={sum(c for _, c in self.prompt.values())} "
                f"generation_tokens={self.generated} ttft={ttft} duration={now - self.start:.3f}s")


class _Tap:
    """Stands in for a request's output queue: notes what passes, then hands it on unchanged."""

    __slots__ = ("queue", "record")

    def __init__(self, queue, record: _Record):
        self.queue, self.record = queue, record

    def put_nowait(self, item) -> None:
        out = item[1]
        if isinstance(out, RequestOutput):
            r = self.record
            if out.new_token_ids:
                if r.first_token is None:
                    r.first_token = time.monotonic()
                r.generated += len(out.new_token_ids)
            if out.num_prompt_tokens:
                r.prompt[out.request_id] = (out.num_prompt_tokens, out.num_cached_tokens)
        self.queue.put_nowait(item)


def tap(queue, request_id: str, app: str | None):
    """What the engine client routes ``request_id``'s outputs to (``state.EngineClient``'s ``tap``): within an
    HTTP request's record, a stand-in for ``queue`` that notes them in it; outside one, ``queue`` itself."""
    record = _current.get()
    if record is None:
        return queue
    record.ids.append(request_id)
    record.app = app or "default"
    return _Tap(queue, record)


class AccessLog:
    """ASGI wrapper writing the access line of every HTTP request once its response is sent."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = _Record(time.monotonic())
        token = _current.set(record)

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            _current.reset(token)
            level = logging.DEBUG if scope["path"] in SCRAPED_PATHS else logging.INFO
            log.log(level, "%s", record.line(scope["method"], scope["path"], time.monotonic()))
