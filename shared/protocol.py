"""The wire between gateways and the engine: msgspec Structs encoded with msgpack.

Hot-path structs travel as arrays (``array_like=True``): their fields may only
be appended, never reordered or removed.
"""

from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct, array_like=True, gc=False):
    """Log-probability of one generated token, with the top alternatives when asked for."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """What one engine step produced for one request.

    ``new_token_ids`` includes the stop token that ended the request (it counts
    as a completion token, as in vLLM); ``stop_token_id`` names it so that the
    gateway leaves it out of the text.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[Logprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    stop_token_id: int | None = None
