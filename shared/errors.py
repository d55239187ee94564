"""The one hierarchy of mlxd errors.

Every error that can reach a client is one of these. The engine sends its
``code`` on the wire; the gateway maps ``status`` to the HTTP status and
``type`` to the OpenAI error body in exactly one place.
"""

from __future__ import annotations


class MlxdError(Exception):
    status = 500
    type = "internal_error"
    code = "internal_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(MlxdError):
    """The request itself is wrong (a field, a prompt too long, a bad grammar)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """The prompt (plus what it asks to generate) can never fit.

    ``prompt_tokens`` and ``max_model_len`` are set when the prompt alone is
    too long: each API words that its own way (Anthropic's clients read theirs
    to shorten the conversation).
    """

    code = "context_length_exceeded"

    def __init__(self, message: str, param: str | None = None, *, prompt_tokens: int | None = None,
                 max_model_len: int | None = None):
        super().__init__(message, param)
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len


class RequestTooLargeError(InvalidRequestError):
    status = 413
    code = "request_too_large"


class RequestHeaderTooLargeError(InvalidRequestError):
    """A request head (request line and headers) over the gateway's limit."""

    status = 431
    code = "request_header_too_large"


class RequestTimeoutError(InvalidRequestError):
    """The client stopped sending its request part-way."""

    status = 408
    code = "request_timeout"


class UnsupportedMediaTypeError(InvalidRequestError):
    """A body that is not declared JSON (a browser's form or text/plain post, which needs no preflight)."""

    status = 415
    code = "unsupported_media_type"


class ForbiddenError(MlxdError):
    """A browser page of a foreign origin, or a Host name this server does not answer to (DNS rebinding)."""

    status = 403
    type = "permission_error"
    code = "forbidden"


class AuthenticationError(MlxdError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFoundError(MlxdError):
    status = 404
    type = "not_found_error"
    code = "model_not_found"


class OverloadedError(MlxdError):
    """The waiting queue is full; the client should retry later."""

    status = 429
    type = "rate_limit_error"
    code = "overloaded"


class EngineUnavailableError(MlxdError):
    """The engine is loading, dead or unreachable."""

    status = 503
    type = "service_unavailable"
    code = "engine_unavailable"


class ClientGoneError(MlxdError):
    """The client hung up before its answer began: its engine requests are never sent, or aborted;
    the answer (nginx's 499, client closed request) goes to a closed connection, for the metrics."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"


class ModelLoadError(MlxdError):
    """A model could not be found or loaded (missing file, offline and not cached, unsupported)."""

    code = "model_load_error"


_BY_CODE = {
    cls.code: cls
    for cls in (
        MlxdError,
        InvalidRequestError,
        ContextLengthError,
        AuthenticationError,
        NotFoundError,
        OverloadedError,
        EngineUnavailableError,
        ModelLoadError,
    )
}


def error_from_code(code: str, message: str, param: str | None = None) -> MlxdError:
    """Rebuild an error received on the wire from its code."""
    return _BY_CODE.get(code, MlxdError)(message, param)


class MemoryBudgetError(MlxdError):
    """The memory budget cannot hold the weights, the warm-up activations and one full-length request."""

    code = "insufficient_memory"


_BY_CODE[MemoryBudgetError.code] = MemoryBudgetError
