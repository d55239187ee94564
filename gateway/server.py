"""`mlxd gateway`: the Starlette app, what every request passes through before its route (HTTP metrics,
the guards), and how it runs under uvicorn and shuts down. The process's state and the opening every
route shares (the API key, the body, the engine, the model) are ``gateway.state``'s.

On SIGTERM/SIGINT the gateway stops accepting connections and gives open
requests ``shutdown_timeout`` seconds to finish (one not sent to the engine yet,
its body still arriving, is refused with a 503); then it ends each one that
is left with an error its client can read (a JSON error body, or an SSE
error event and ``[DONE]``) and aborts it in the engine, and exits.
uvicorn's own grace only has to cover writing those last words. Under `mlxd
serve` the engine is told to stop in the same moment (``supervisor``'s
``begin_stop``): both count down one timeout, not one after the other.

The HTTP metrics, served on the gateway's own ``/metrics``: requests by route
and status, their duration, those in progress and the event streams still
open. The names and labels are those of prometheus-fastapi-instrumentator,
which vLLM's API server serves (``http_requests_total{handler,method,status}``,
``http_request_duration_seconds``, ``http_requests_inprogress``), so a query
written for vLLM's HTTP series reads these; ``status`` is the exact code
("429", not its grouped "4xx"). ``handler`` is the route's template
(``/v1/models/{model:path}``), or ``none`` for a path no route matches: a
scanner's stream of made-up paths cannot grow the series without bound. Each
app builds its own registry (several gateways may live in one test process).

The guards refuse what a slow, hostile or foreign HTTP client sends before a
route reads a field.

Request heads (``HeadGuardProtocol``, uvicorn's HTTP/1.1 protocol with a
deadline and a size): uvicorn times out a keep-alive connection only while it
is silent, and a new connection never: a client that sends half a request
line, or one header a minute, holds its connection (and a file descriptor) for
ever. Here every connection that is waiting for a request head (a new one, or
a kept-alive one after its last response) must complete the head within
``request_timeout`` seconds, or it is closed. A head over ``MAX_HEAD_BYTES``
is a 431, and a head h11 cannot parse a 400, each in the error shape of the
route it names (uvicorn answers both with a text/plain 400, and closes with
the rest of a long head unread, which resets the connection before the client
reads the answer).

Paths (``TrailingSlash``): ``/v1/chat/completions/`` is served as
``/v1/chat/completions``, where Starlette would redirect it (307), which
clients posting a body do not all follow.

Web pages (``BrowserGuard``, ASGI middleware): a page on any site can make a
browser post to http://127.0.0.1:8000 (a "simple" text/plain POST needs no
CORS preflight), or rebind its own domain name to 127.0.0.1 and read the
answers. So:

- the Host header must be a loopback name, an IP literal, the configured
  ``--host`` or one of ``--allowed-hosts`` (a rebound domain carries its own
  name, which is none of these);
- a request carrying an Origin header (browsers send one on cross-origin and
  on all POST requests) is refused unless ``--allowed-origins`` lists it;
- a POST to a route must declare a JSON body, which a page can only send after
  a CORS preflight that the rule above refuses (a path no route serves is a
  404 whatever its body).

Refusals are 403/415 in the shape of the route's API.

Over 400 lines because the app's construction and every guard in front of the routes (host,
origin, content type, request-head limits, keys) are read together: each guard's order matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import sys
import time
from http import HTTPStatus

import h11
import msgspec
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxd.gateway.errors import ANTHROPIC_PREFIX, error_response, handle_exception
from mlxd.gateway.parsers import check_names
from mlxd.gateway.routes import ROUTES
from mlxd.gateway.state import SHUTTING_DOWN, Fleet, ModelRouter
from mlxd.shared.errors import (ForbiddenError, InvalidRequestError, MlxdError, RequestHeaderTooLargeError,
                           UnsupportedMediaTypeError)
from mlxd.shared.serve_config import GatewayConfig

log = logging.getLogger("mlxd.gateway")

# Seconds after the drain deadline for the error bodies and events to reach their clients.
_FLUSH_GRACE_S = 5.0
_TICK_S = 0.2
# Seconds: metadata routes answer in milliseconds, a long generation streams for minutes.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
UNMATCHED = "none"


def build_app(config: GatewayConfig, fleet: Fleet | None = None) -> Starlette:
    """``fleet``: what starts an engine on demand (`mlxd serve --keep-alive`; see gateway.state.ModelRouter)."""
    check_names(config.tool_call_parser, config.reasoning_parser)
    state = ModelRouter(config, fleet)
    metrics = GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        try:
            yield
        finally:
            await state.close()

    # Metrics see every request, a refused one too; then the guard: a refused browser request
    # never reaches CORS or a route.
    middleware = [Middleware(TrailingSlash), Middleware(HTTPMetrics, metrics=metrics, routes=ROUTES),
                  Middleware(BrowserGuard, routes=ROUTES, bind_host=config.host,
                             allowed_hosts=config.allowed_hosts, allowed_origins=config.allowed_origins)]
    if config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                                     allow_methods=["*"], allow_headers=["*"]))
    app = Starlette(
        routes=ROUTES,
        exception_handlers={Exception: handle_exception, HTTPException: handle_exception,
                            MlxdError: handle_exception,
                            msgspec.ValidationError: handle_exception,
                            msgspec.DecodeError: handle_exception},
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.gw = state
    app.state.metrics = metrics
    return app


# HTTP metrics (see the module docstring).


class GatewayMetrics:
    """The app's own Prometheus registry and its HTTP series (see the module docstring)."""

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


# Guards: what the gateway refuses of a slow, hostile or foreign HTTP client (see the module docstring).

# Request heads.

# uvicorn's limit (h11's 16 KiB) refuses the long tokens and cookies that proxies and single
# sign-on put in headers; 64 KiB holds them.
MAX_HEAD_BYTES = 64 << 10
# Seconds a refused connection is still read (and what comes dropped) after its answer: a socket
# closed with unread bytes is reset, and the client may lose the answer before reading it.
_LINGER_S = 2.0


def head_bytes(request: h11.Request) -> int:
    """The size of a request's head as it came on the wire, give or take its whitespace."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


class HeadConnection(h11.Connection):
    """h11's server side that refuses a whole head over ``max_head_bytes`` as it refuses a head still
    incomplete past it (with status hint 431), and keeps what it refused: the error, and the
    request target, which names the route whose error shape the answer takes."""

    def __init__(self, max_head_bytes: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.error: h11.RemoteProtocolError | None = None
        self.target = b""

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            # An incomplete head is still in the buffer: its request line, as far as it came.
            line = self.trailing_data[0].partition(b"\r\n")[0].split(b" ")
            self.error, self.target = e, line[1] if len(line) > 1 else b""
            raise
        if isinstance(event, h11.Request) and head_bytes(event) > self.max_head_bytes:
            self.error = h11.RemoteProtocolError("request head too large", error_status_hint=431)
            self.target = event.target
            raise self.error
        return event


class HeadGuardProtocol(H11Protocol):
    request_timeout = 30.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = HeadConnection(MAX_HEAD_BYTES)
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if not self._refused:  # a refused connection is read only to be closed cleanly
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 refused: here the route's JSON error, with h11's status."""
        error = self.conn.error
        if error is not None and error.error_status_hint == 431:
            exc = RequestHeaderTooLargeError(f"the request head (request line and headers) is over "
                                             f"{MAX_HEAD_BYTES >> 10} KiB")
        else:
            exc = InvalidRequestError(f"invalid HTTP request: {error or msg}")
        response = error_response(exc, anthropic=self.conn.target.startswith(ANTHROPIC_PREFIX.encode()))
        status = response.status_code
        head = h11.Response(status_code=status, reason=HTTPStatus(status).phrase.encode(),
                            headers=[*response.raw_headers, (b"connection", b"close")])
        for event in (head, h11.Data(data=response.body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        # Say the answer is whole, then drop what the client still sends until it closes.
        self._refused = True
        self._cancel_head_deadline()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self.transport.close)

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


def protocol_with_deadline(request_timeout: float) -> type[HeadGuardProtocol]:
    """The protocol class for uvicorn's ``http=``, with this deadline."""
    return type("HeadGuardProtocol", (HeadGuardProtocol,), {"request_timeout": request_timeout})


# Paths.

class TrailingSlash:
    """ASGI middleware: a path's trailing slashes are dropped before anything routes it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
        await self.app(scope, receive, send)


# Web pages.

LOOPBACK_NAMES = ("localhost",)


def host_name(host: str) -> str:
    """The name or address of a Host header, without its port and brackets, lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


FORM_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")


def is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BrowserGuard:
    """ASGI middleware; ``bind_host`` is the gateway's --host."""

    def __init__(self, app, routes, bind_host: str, allowed_hosts: list[str], allowed_origins: list[str]):
        self.app = app
        self.routes = routes
        self.any_host = "*" in allowed_hosts
        self.hosts = {host_name(h) for h in (bind_host, *allowed_hosts, *LOOPBACK_NAMES)}
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def check(self, method: str, headers: dict[bytes, bytes], routed: bool, path: str = "") -> MlxdError | None:
        """The refusal of a request, if any; ``routed``: a route serves its path and method."""
        host = headers.get(b"host")
        if host is not None and not self.any_host:
            name = host_name(host.decode("latin-1"))
            if not (_is_ip(name) or name in self.hosts or name.endswith(".localhost")):
                return ForbiddenError(f"this server does not answer to the host name {name!r} "
                                      "(start it with --allowed-hosts to add one)")
        origin = headers.get(b"origin")
        if origin is not None and not self.any_origin:
            value = origin.decode("latin-1").rstrip("/").lower()
            if value not in self.origins:
                return ForbiddenError(f"requests from the web origin {value!r} are refused "
                                      "(start the server with --allowed-origins to allow one)")
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        # OpenAI's audio routes take a multipart upload; a foreign page's form is refused by its Origin above.
        if path in FORM_PATHS and content_type.startswith("multipart/form-data"):
            return None
        if method == "POST" and routed and not is_json(content_type):
            return UnsupportedMediaTypeError("the request body must be JSON, sent as Content-Type: application/json",
                                             param="content-type")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            routed = any(route.matches(scope)[0] is Match.FULL for route in self.routes)
            err = self.check(scope["method"], headers, routed, scope["path"])
            if err is not None:
                response = error_response(err, anthropic=scope["path"].startswith(ANTHROPIC_PREFIX))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Running: uvicorn, and how the gateway stops.


def run_gateway(config: GatewayConfig, supervisor=None) -> int:
    """Serve until interrupted; returns the exit code.

    ``supervisor`` (under `mlxd serve`; see mlxd/serve.py) is polled while the
    gateway runs, with each model's idle seconds: a non-None answer is the exit
    code serve ends with. When the gateway begins to stop, its ``begin_stop()``
    stops the engines too. One that starts engines on demand (``on_demand``) is
    also the router's fleet.
    """
    if config.api_key_file is not None:
        config.api_key = _read_key_file(config.api_key_file)
    app = build_app(config, supervisor if supervisor is not None and supervisor.on_demand else None)
    if config.enable_log_requests:
        from mlxd.gateway.access_log import AccessLog

        asgi = AccessLog(app)
    else:
        asgi = app
    # uvicorn's own access log stays off: it knows no tokens, apps or time to first token.
    server = uvicorn.Server(uvicorn.Config(asgi, host=config.host, port=config.port,
                                           log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=config.shutdown_timeout + _FLUSH_GRACE_S,
                                           http=protocol_with_deadline(config.request_timeout)))
    router: ModelRouter = app.state.gw
    url = f"http://{config.host}:{config.port}/v1"
    # Nothing is served before the engine is (the model routes answer 503): the line that says a
    # URL serves waits for each engine's READY.
    endpoints = ", ".join(e.client.endpoint for e in router.engines)
    print(f"mlxd gateway: starting on {url}, waiting for the engine at {endpoints}", file=sys.stderr, flush=True)

    async def main() -> int:
        task = asyncio.create_task(server.serve())
        rc, deadline, ended, announced = 0, None, False, set()
        while not task.done():
            await asyncio.sleep(_TICK_S)
            for e in router.engines:
                # Once per engine instance: a model loaded again on demand is announced again.
                if e.client.ready and e.client.info.instance_id not in announced:
                    announced.add(e.client.info.instance_id)
                    print(f"mlxd gateway: serving {e.client.info.served_model_name} on {url}", file=sys.stderr,
                          flush=True)
            if supervisor is not None and not server.should_exit:
                code = supervisor.poll(router.idle_seconds())
                if code is not None:
                    rc, server.should_exit = code, True
            if server.should_exit and deadline is None:
                deadline = time.monotonic() + config.shutdown_timeout
                for e in router.engines:
                    e.client.stopping = True
                if supervisor is not None:
                    supervisor.begin_stop()
                log.info("shutting down: open requests get %.1fs to finish", config.shutdown_timeout)
            if deadline is not None and not ended and time.monotonic() >= deadline:
                ended = True
                n = sum(e.client.end_all(SHUTTING_DOWN) for e in router.engines)
                if n:
                    log.info("ended %d request(s) still open after the shutdown timeout", n)
        await task
        return rc

    def on_signal(_signum, _frame):
        server.should_exit = True

    # uvicorn handles SIGINT/SIGTERM during serve() and raises the signal again when it returns,
    # under the handlers it found: these, so that the process is not killed there (by SIGTERM's
    # default action) before its callers stop the engine they started, and so that a signal
    # that comes before uvicorn listens still stops it.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return asyncio.run(main())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read_key_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as e:
        raise InvalidRequestError(f"--api-key-file {path}: {e.strerror}", param="api_key_file") from e
    if not key:
        raise InvalidRequestError(f"--api-key-file {path} is empty", param="api_key_file")
    return key
