"""Per-request sampling parameters: built by the gateway, carried on the wire, applied by the engine."""

from __future__ import annotations

import msgspec

from shared.errors import InvalidRequestError


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class StructuredSpec(msgspec.Struct, array_like=True, gc=False):
    """A constraint on the output, compiled by the engine (llguidance).

    ``kind`` is one of ``STRUCTURED_KINDS``; ``spec`` is the JSON schema text
    (json_schema), ignored (json_object), a regular expression (regex), a JSON
    list of strings (choice), or a Lark grammar (grammar).
    """

    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """What to generate for one request (one choice; ``n > 1`` is fanned out by the gateway).

    Fields may only be appended: the struct travels as an array.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top k
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # False opts this request out of speculative decoding.
    speculate: bool = True
    # Constrained decoding; None: unconstrained.
    structured: StructuredSpec | None = None

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first field out of range.

        The ranges are what the engine's sampler and the msgpack wire can
        hold: an int the engine cannot take (a top_k past the vocabulary, a
        seed past int64) must never reach a step.
        """
        checks = (
            ("max_tokens", 1 <= self.max_tokens <= INT32_MAX, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", -1 <= self.top_k <= vocab_size, f"must be -1 or 0 (off), or in [1, {vocab_size}]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 100.0, "must be in (0, 100]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("seed", self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "must fit in a signed 64-bit integer"),
            (
                "logit_bias",
                not self.logit_bias or all(0 <= t < vocab_size for t in self.logit_bias),
                f"token ids must be in [0, {vocab_size})",
            ),
            (
                "stop_token_ids",
                all(0 <= t < vocab_size for t in self.stop_token_ids),
                f"token ids must be in [0, {vocab_size})",
            ),
        )
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}", param="structured")
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {why}", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
