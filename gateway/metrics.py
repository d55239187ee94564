"""The gateway's HTTP metrics, served on its own ``/metrics``: requests by route and status, their
duration, those in progress and the event streams still open.

The names and labels are those of prometheus-fastapi-instrumentator, which vLLM's API server
serves (``http_requests_total{handler,method,status}``, ``http_request_duration_seconds``,
``http_requests_inprogress``), so a query written for vLLM's HTTP series reads these; ``status``
is the exact code ("429", not its grouped "4xx"). ``handler`` is the route's template
(``/v1/models/{model:path}``), or ``none`` for a path no route matches: a scanner's stream of
made-up paths cannot grow the series without bound. Each app builds its own registry (several
gateways may live in one test process).
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match

# Seconds: metadata routes answer in milliseconds, a long generation streams for minutes.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
UNMATCHED = "none"


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("http_requests_total", "HTTP requests by route, method and status.",
                                ["handler", "method", "status"], registry=self.registry)
        self.duration = Histogram("http_request_duration_seconds", "HTTP request duration, until the last "
                                  "byte of the body (a stream's whole length).", ["handler", "method"],
                                  buckets=DURATION_BUCKETS, registry=self.registry)
        self.in_progress = Gauge("http_requests_inprogress", "HTTP requests being answered.",
                                 ["handler", "method"], registry=self.registry)
        self.streams = Gauge("mlxd_gateway_streams_in_flight", "Server-sent event streams still open.",
                             ["handler"], registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


async def metrics_endpoint(request: Request) -> Response:
    """GET /metrics: Prometheus's text format (no key: like /health, it says nothing of the prompts)."""
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


class HTTPMetrics:
    """ASGI middleware that measures every HTTP request; pure ASGI so streamed bodies pass through as they go."""

    def __init__(self, app, metrics: GatewayMetrics, routes):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def _handler(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:  # PARTIAL: the path's route, answered 405 for the method
                return route.path
        return UNMATCHED

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        m = self.metrics
        handler, method = self._handler(scope), scope["method"]
        status = 500  # an exception before any response is answered 500 further out
        stream = None
        started = time.perf_counter()
        in_progress = m.in_progress.labels(handler, method)
        in_progress.inc()

        async def measured_send(message) -> None:
            nonlocal status, stream
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers") or ())
                if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                    stream = m.streams.labels(handler)
                    stream.inc()
            await send(message)

        try:
            await self.app(scope, receive, measured_send)
        finally:
            in_progress.dec()
            if stream is not None:
                stream.dec()
            m.requests.labels(handler, method, str(status)).inc()
            m.duration.labels(handler, method).observe(time.perf_counter() - started)
