"""Every error a client can see becomes an OpenAI error body here, and only here.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status of
the error's class in ``shared.errors``.
"""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from shared.errors import InvalidRequestError, MlxdError

log = logging.getLogger("mlxd.gateway")

class RequestTooLargeError(InvalidRequestError):
    status = 413
    code = "request_too_large"


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def to_mlxd_error(exc: BaseException) -> MlxdError:
    """Whatever went wrong, as an MlxdError (unknown exceptions are logged: they are bugs)."""
    if isinstance(exc, MlxdError):
        return exc
    if isinstance(exc, msgspec.ValidationError):
        # msgspec says where: "Expected `int`, got `str` - at `$.max_tokens`"
        m = _PATH.search(str(exc))
        param = m.group(1) if m and m.group(1) else None
        missing = _MISSING.search(str(exc))
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        return InvalidRequestError(f"invalid request body: {exc}", param=param)
    if isinstance(exc, msgspec.DecodeError):
        return InvalidRequestError(f"the request body is not valid JSON: {exc}")
    if isinstance(exc, HTTPException):
        err = MlxdError(exc.detail or "HTTP error")
        err.status = exc.status_code
        err.type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        err.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return err
    log.error("unexpected error", exc_info=exc)
    return MlxdError(f"internal error: {type(exc).__name__}: {exc}")


def error_body(exc: BaseException) -> tuple[int, dict]:
    e = to_mlxd_error(exc)
    return e.status, {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    headers = None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif status in (429, 503):
        # The queue drains or the engine comes back within seconds: say when to retry.
        headers = {"Retry-After": "1"}
    return JSONResponse(body, status_code=status, headers=headers)


def sse_error_event(exc: BaseException) -> bytes:
    """An error inside an open stream: the status is already sent, so the body says it."""
    _, body = error_body(exc)
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def handle_exception(_request, exc: Exception) -> JSONResponse:
    """Starlette exception handler: routes raise, this answers."""
    return error_response(exc)
