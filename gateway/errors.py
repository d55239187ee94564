"""Every error a client can see becomes an error body here, and only here.

OpenAI's ``{"error": {"message", "type", "param", "code"}}``, or on
Anthropic's /v1/messages routes ``{"type": "error", "error": {"type",
"message"}}``, with the HTTP status of the error's class in ``shared.errors``.
"""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from mlxd.shared.errors import ContextLengthError, InvalidRequestError, MlxdError

log = logging.getLogger("mlxd.gateway")


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


# Anthropic's error types by HTTP status; its SDK picks exception classes by status.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                    413: "request_too_large", 415: "invalid_request_error", 431: "invalid_request_error",
                    429: "rate_limit_error", 503: "overloaded_error"}

ANTHROPIC_PREFIX = "/v1/messages"


def _anthropic_message(e: MlxdError) -> str:
    """Anthropic's own wording for a prompt over the context, which its clients match to recover
    (max_tokens past the room left is clamped on these routes, so that error never arises)."""
    if isinstance(e, ContextLengthError) and e.prompt_tokens is not None:
        # The longest prompt that still leaves room for one token.
        return f"prompt is too long: {e.prompt_tokens} tokens > {e.max_model_len - 1} maximum"
    return e.message


def anthropic_error_body(exc: BaseException) -> tuple[int, dict]:
    e = to_mlxd_error(exc)
    return e.status, {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(e.status, "api_error"),
                                                 "message": _anthropic_message(e)}}


def anthropic_sse_error_event(exc: BaseException) -> bytes:
    """An error inside an open Anthropic stream: its ``error`` event."""
    _, body = anthropic_error_body(exc)
    return b"event: error\ndata: " + msgspec.json.encode(body) + b"\n\n"


def error_response(exc: BaseException, anthropic: bool = False) -> JSONResponse:
    status, body = anthropic_error_body(exc) if anthropic else error_body(exc)
    headers = None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif status in (429, 503):
        # The queue drains or the engine comes back within seconds: say when to retry.
        headers = {"Retry-After": "1"}
    return JSONResponse(body, status_code=status, headers=headers)


def sse_error_event(exc: BaseException) -> bytes:
    """An error inside an open stream: the status is already sent, so the body says it.

    Then ``[DONE]``, as every OpenAI stream ends: a client reading up to it knows the
    stream ended on purpose, not by a cut connection.
    """
    _, body = error_body(exc)
    return b"data: " + msgspec.json.encode(body) + b"\n\ndata: [DONE]\n\n"


async def handle_exception(request, exc: Exception) -> JSONResponse:
    """Starlette exception handler: routes raise, this answers in the shape of the route's API."""
    return error_response(exc, anthropic=request.url.path.startswith(ANTHROPIC_PREFIX))
