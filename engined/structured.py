"""Structured output: llguidance matchers that constrain what a request may sample.

A request whose ``SamplingParams.structured`` is set gets a ``Grammar``. Its
matcher is compiled on a worker thread (llguidance drops the GIL while it
compiles), so the step loop never waits for it: the scheduler leaves the
request waiting until ``ready`` and admits everyone else. A grammar that does
not compile fails its request with an InvalidRequestError before it is ever
scheduled.

Each step the sampler asks ``token_bitmask`` for the constrained rows only;
the bits (one per vocabulary entry, packed 32 to an int32) are computed by
llguidance on its own threads into one numpy array and turned into a boolean
mask on the device. Every accepted token advances the matcher; a matcher that
has nothing left to match ends the request with ``stop``.

A grammar is the client's text: llguidance's errors are asked for without the
grammar and parser state it appends by default, and a log line carries only the
request id and the error's first line. (A compile error goes back to the client
whole: it points into the client's own grammar.)

A speculating request needs one mask per row of its verification window, each
after a different prefix of the draft: ``DraftWalk`` consumes the draft
tokens one by one, filling a mask before each, and rolls the matcher back, so
that only the tokens verification accepts advance it for good.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.hub import load_tokenizer
from mlxd.shared.protocol import StructuredSpec

log = logging.getLogger("mlxd.structured")

# Compact JSON with one space after separators: a small model given free
# whitespace can spend its whole budget on newlines inside an object.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = np.arange(32, dtype=np.int32)


def _limits():
    """llguidance's default limits, with errors that do not quote the grammar."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def short_error(matcher) -> str:
    """The first line of a matcher's error, for a log line (what follows may quote the grammar)."""
    lines = (matcher.get_error() or "").splitlines()
    return lines[0][:200] if lines else ""


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar for a spec; InvalidRequestError for specs malformed on their face."""
    import llguidance
    from llguidance import LLMatcher

    kind, text = spec.kind, spec.spec
    try:
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise ValueError("choice needs a non-empty list of strings")
            return llguidance.grammar_from("choice", choices)
        if kind == "grammar":
            # Lark, or GBNF (converted to Lark by llguidance).
            return llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise InvalidRequestError(f"invalid {kind} for structured output: {e}", param="structured") from None
    raise InvalidRequestError(f"unknown structured output kind {kind!r}", param="structured")


class Grammar:
    """One request's matcher: compiling (``future``), then ``matcher``; or failed with ``error``."""

    __slots__ = ("kind", "future", "matcher", "error", "request_id")

    def __init__(self, kind: str, future: Future, request_id: str = ""):
        self.kind = kind
        self.future = future
        self.request_id = request_id  # for log lines
        self.matcher = None
        self.error: InvalidRequestError | None = None

    @property
    def ready(self) -> bool:
        """True once compiled (or failed); the scheduler admits the request only then."""
        if self.matcher is None and self.error is None and self.future.done():
            try:
                self.matcher = self.future.result()
            except InvalidRequestError as e:
                self.error = e
            except Exception as e:  # llguidance refused it some other way: still the request's fault
                self.error = InvalidRequestError(f"invalid {self.kind}: {e}", param="structured")
        return self.matcher is not None or self.error is not None

    def accept(self, token: int) -> str | None:
        """Advance past a sampled token; returns "stop" when the grammar is complete."""
        m = self.matcher
        if not m.consume_token(token):
            # Only reachable when something outside the mask chose the token
            # (e.g. an EOS the grammar did not expect): end rather than emit
            # output the grammar rejects.
            log.warning("request %s: grammar rejected token %d: %s", self.request_id, token, short_error(m))
            return "stop"
        return "stop" if m.is_stopped() else None

    def check_draft(self, draft: list[int], bits: np.ndarray) -> int:
        """Masks for a verification window; returns how many leading draft tokens the grammar allows.

        ``bits [len(draft) + 1, words]`` (int32, all set on entry) gets in row
        ``i`` the allowed tokens after the first ``i`` draft tokens, for rows up
        to the returned count ``n``; the draft must be cut to ``draft[:n]``.
        The matcher ends where it started.
        """
        walk = DraftWalk(self.matcher, bits)
        for token in draft:
            walk.fill()
            if not walk.push(token):
                break
        return walk.finish()


class DraftWalk:
    """Steps one matcher along a draft as it is made, filling the mask of each window row.

    Call ``fill`` (the mask of row ``n``, where ``n`` draft tokens are
    consumed), then ``push`` the token chosen there; ``finish`` fills the
    row after the last consumed token and rolls the matcher back to where it
    began. A token outside its row's mask is never consumed (a rejected token
    would leave the matcher in an error state that rollback cannot undo), nor
    is anything after the grammar has stopped (the request ends there). Rows
    past the walk's end stay as they were: verification rejects at or before
    them, or the request has ended.
    """

    __slots__ = ("matcher", "bits", "n", "filled", "open")

    def __init__(self, matcher, bits: np.ndarray):
        self.matcher = matcher
        self.bits = bits
        self.n = 0  # draft tokens consumed
        self.filled = 0  # rows whose mask is computed
        self.open = True

    def fill(self) -> None:
        if self.open and self.filled == self.n:
            from llguidance.numpy import fill_next_token_bitmask

            fill_next_token_bitmask(self.matcher, self.bits, self.n)
            self.filled += 1

    def push(self, token: int) -> bool:
        """Consume the draft token of row ``n`` if its mask allows it; False ends the walk."""
        allowed = self.open and self.filled > self.n and (self.bits[self.n, token >> 5] >> (token & 31)) & 1
        if not allowed or not self.matcher.consume_token(token):
            self.open = False
            return False
        self.n += 1
        if self.matcher.is_stopped():
            # Stopped: only EOS may follow, and consuming it would not count towards rollback.
            self.fill()
            self.open = False
        return True

    def finish(self) -> int:
        """Fill the last row, roll the matcher back; returns the number of draft tokens it allowed."""
        self.fill()
        self.open = False
        if self.n and not self.matcher.rollback(self.n):
            # Only if llguidance's mask and matcher disagreed: the matcher is in
            # error, and its request ends at its next token (``Grammar.accept``).
            log.warning("grammar rollback failed: %s", short_error(self.matcher))
        return self.n


class GrammarCompiler:
    """Compiles grammars on worker threads and fills bitmasks for a step's constrained rows.

    The llguidance tokenizer is built once, on the first constrained request
    (about a second), from the model's tokenizer directory. Compiled grammars
    are kept by their text (LRU), so a repeated schema costs a copy.
    """

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int],
                 max_workers: int = 2, cache_size: int = 64):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._tokenizer = None
        self._executor = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size

    def submit(self, spec: StructuredSpec, request_id: str = "") -> Grammar:
        """Start compiling; raises InvalidRequestError at once for a spec malformed on its face."""
        text = grammar_text(spec)
        return Grammar(spec.kind, self._pool.submit(self._compile, spec.kind, text), request_id)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance
                import llguidance.hf

                hf = load_tokenizer(self.tokenizer_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def _compile(self, kind: str, text: str):
        from llguidance import LLMatcher

        tok = self.tokenizer()
        with self._lock:
            template = self._cache.get(text)
            if template is not None:
                self._cache.move_to_end(text)
        if template is None:
            template = LLMatcher(tok, text, log_level=0, limits=_limits())
            if template.is_error():
                raise InvalidRequestError(f"invalid {kind} for structured output: {template.get_error()}",
                                          param="structured")
            with self._lock:
                self._cache[text] = template
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return template.deep_copy()

    def token_bitmask(self, grammars: list[Grammar | None]) -> mx.array | None:
        """Allowed tokens ``[S, V]`` (bool) for a step's rows, or None when no row is constrained.

        Unconstrained rows allow everything.
        """
        rows = [(g.matcher, i) for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        from llguidance.numpy import fill_next_token_bitmask_par

        bits = self.new_bits(len(grammars))
        fill_next_token_bitmask_par(self._executor, rows, bits)
        return self.to_mask(bits)

    def new_bits(self, rows: int) -> np.ndarray:
        """Packed masks ``[rows, words]`` (int32) allowing every token."""
        return np.full((rows, self.words), -1, dtype=np.int32)

    def to_mask(self, bits: np.ndarray) -> mx.array:
        """Packed masks to allowed tokens ``[rows, V]`` (bool) on the device."""
        allowed = (mx.array(bits)[:, :, None] >> mx.array(_BITS)) & 1
        return allowed.reshape(len(bits), -1)[:, : self.vocab_size].astype(mx.bool_)
