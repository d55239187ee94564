"""Request bodies (``decode_body``): size, time and nesting bounded, JSON into a typed Struct.

Everything here raises InvalidRequestError (or a subclass with its own status), so that a hostile
body is a 4xx and never an exception the route did not expect.
"""

from __future__ import annotations

import asyncio

import msgspec
from starlette.requests import Request

from gateway.params import MAX_JSON_DEPTH, check_depth
from shared.errors import InvalidRequestError, RequestTimeoutError, RequestTooLargeError

# Far above any context window's worth of text; stops a client from filling the gateway's memory.
MAX_BODY_BYTES = 64 << 20


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
