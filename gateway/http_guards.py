"""What the gateway refuses of a slow, hostile or foreign HTTP client, before a route reads a field.

Request heads (``HeadDeadlineProtocol``, uvicorn's HTTP/1.1 protocol with a
deadline): uvicorn times out a keep-alive connection only while it is silent,
and a new connection never: a client that sends half a request line, or one
header a minute, holds its connection (and a file descriptor) for ever. Here
every connection that is waiting for a request head (a new one, or a
kept-alive one after its last response) must complete the head within
``request_timeout`` seconds, or it is closed.

Web pages (``BrowserGuard``, ASGI middleware): a page on any site can make a
browser post to http://127.0.0.1:8000 (a "simple" text/plain POST needs no
CORS preflight), or rebind its own domain name to 127.0.0.1 and read the
answers. So:

- the Host header must be a loopback name, an IP literal, the configured
  ``--host`` or one of ``--allowed-hosts`` (a rebound domain carries its own
  name, which is none of these);
- a request carrying an Origin header (browsers send one on cross-origin and
  on all POST requests) is refused unless ``--allowed-origins`` lists it;
- a POST must declare a JSON body, which a page can only send after a CORS
  preflight that the rule above refuses.

Refusals are 403/415 in the shape of the route's API.

Request bodies (``decode_body``): size, time and nesting bounded, JSON into a
typed Struct. Everything there raises InvalidRequestError (or a subclass with
its own status), so that a hostile body is a 4xx and never an exception the
route did not expect.
"""

from __future__ import annotations

import asyncio
import ipaddress

import h11
import msgspec
from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import ANTHROPIC_PREFIX, error_response
from shared.errors import (ForbiddenError, InvalidRequestError, MlxdError, RequestTimeoutError, RequestTooLargeError,
                           UnsupportedMediaTypeError)


# Request heads.

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


def is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BrowserGuard:
    """ASGI middleware; ``bind_host`` is the gateway's --host."""

    def __init__(self, app, bind_host: str, allowed_hosts: list[str], allowed_origins: list[str]):
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {host_name(h) for h in (bind_host, *allowed_hosts, *LOOPBACK_NAMES)}
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def check(self, method: str, headers: dict[bytes, bytes]) -> MlxdError | None:
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
        if method == "POST" and not is_json(headers.get(b"content-type", b"").decode("latin-1")):
            return UnsupportedMediaTypeError("the request body must be JSON, sent as Content-Type: application/json",
                                             param="content-type")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            err = self.check(scope["method"], headers)
            if err is not None:
                response = error_response(err, anthropic=scope["path"].startswith(ANTHROPIC_PREFIX))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Request bodies.

# Far above any context window's worth of text; stops a client from filling the gateway's memory.
MAX_BODY_BYTES = 64 << 20

# Deeper than any real tool schema or tool-call arguments (a dozen levels), far
# below what recursive code downstream (json, Jinja's tojson, grammar
# compilers) survives; msgspec itself gives up near 1,000.
MAX_JSON_DEPTH = 64


async def read_body(request: Request) -> bytes:
    """The request body, refusing (413) one over MAX_BODY_BYTES before or while reading it, and
    (408) one whose next chunk does not arrive within --request-timeout seconds (a client that
    stops mid-body would otherwise hold its connection and its task)."""
    idle_timeout = request.app.state.gw.config.request_timeout
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestTooLargeError(f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), idle_timeout)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"no part of the request body arrived for {idle_timeout:g} s") from None
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestTooLargeError(f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(value) -> int:
    """The nesting depth of decoded JSON (a scalar is 0, ``[]`` is 1), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def check_depth(value, param: str | None = None) -> None:
    if json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", param=param)


def loads(text: str | bytes, param: str | None = None):
    """Any JSON value, depth-checked; InvalidRequestError for what is not JSON or nests too deep."""
    try:
        value = msgspec.json.decode(text)
    except RecursionError:
        raise InvalidRequestError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", param=param) from None
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"not valid JSON: {e}", param=param) from None
    check_depth(value, param)
    return value


def decode(body: bytes, typ):
    """``body`` as a ``typ`` Struct; msgspec's ValidationError (a 400 naming the field) when it does not fit."""
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        raise InvalidRequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
    check_depth(value)
    return msgspec.convert(value, typ)


# Bodies above this are decoded in a worker thread: tens of MB of JSON take the loop's time.
THREAD_DECODE_BYTES = 1 << 20


async def decode_body(request: Request, typ):
    """Read and decode a request body into ``typ``."""
    body = await read_body(request)
    if len(body) > THREAD_DECODE_BYTES:
        return await asyncio.to_thread(decode, body, typ)
    return decode(body, typ)
