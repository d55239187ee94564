"""The access log's tap, which the engine client routes each request's outputs through under
--enable-log-requests: an engine request sent while an HTTP request is answered is noted in that request's
access line (its id, app and tokens), and every output reaches its queue unchanged."""

from __future__ import annotations

import asyncio
import logging

from mlxd.gateway import access_log
from mlxd.shared.protocol import RequestOutput


def test_the_tap_notes_a_request_in_its_http_requests_line_and_hands_every_output_on(caplog):
    queue: asyncio.Queue = asyncio.Queue()
    outputs = [(0, RequestOutput("abc-0", [11, 12], num_prompt_tokens=5, num_cached_tokens=4)),
               (0, RequestOutput("abc-0", [13], finish_reason="stop"))]

    async def app(scope, receive, send):
        tapped = access_log.tap(queue, "abc-0", "team")
        for item in outputs:
            tapped.put_nowait(item)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def sent(message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    with caplog.at_level(logging.INFO, logger="mlxd.access"):
        asyncio.run(access_log.AccessLog(app)(scope, None, sent))
    assert [queue.get_nowait() for _ in outputs] == outputs
    line = caplog.records[-1].getMessage()
    assert line.startswith("abc app=team POST /v1/chat/completions 200 "), line
    assert "prompt_tokens=5 cached_tokens=4 generation_tokens=3 " in line, line


def test_outside_an_http_request_the_tap_hands_back_the_queue_itself():
    queue: asyncio.Queue = asyncio.Queue()
    assert access_log.tap(queue, "abc-0", None) is queue
