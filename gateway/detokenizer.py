"""Token ids to the text a client sees: decoded one step at a time, cut at stop strings.

Decoding: a token of a byte-level vocabulary may carry only part of a UTF-8
character (an emoji is often three tokens). Decoding the new tokens alone
would emit U+FFFD for each part. Instead each step decodes a short window of
recent tokens twice, with and without the new ones, and emits the difference
only once it no longer ends in an incomplete character. The window starts a
few tokens back so that tokenizers that strip a leading space at the start of
a decode (SentencePiece) still produce the space.

Stop strings are found across token boundaries and never emitted: text that
could still turn out to be the start of a stop string is held back until the
next tokens either complete the stop string (the request ends there) or rule
it out (the text is released).
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context for the first generated token.
_CONTEXT = 6


class IncrementalDetokenizer:
    """Feed token ids as they come; get the text they complete.

    ``decode(ids) -> str`` is the tokenizer's own decode (special tokens
    skipped or not, as the request asked); the concatenation of everything
    ``add`` and ``flush`` return equals ``decode(all generated ids)`` for the
    tokenizers mlxd serves.
    """

    __slots__ = ("_decode", "_tokens", "_prefix", "_read")

    def __init__(self, decode, prompt_ids: list[int] | None = None):
        self._decode = decode
        self._tokens = list(prompt_ids[-_CONTEXT:]) if prompt_ids else []
        self._prefix = 0  # start of the decode window
        self._read = len(self._tokens)  # tokens before this are already emitted

    def add(self, ids: list[int]) -> str:
        if not ids:
            return ""
        self._tokens.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        tokens = self._tokens
        if self._read == len(tokens):
            return ""
        before = self._decode(tokens[self._prefix:self._read])
        after = self._decode(tokens[self._prefix:])
        if not final and (len(after) <= len(before) or after.endswith(_REPLACEMENT)):
            return ""
        # `after` normally extends `before`; where a tokenizer rewrites the
        # seam, the common prefix is what was already emitted.
        if after.startswith(before):
            delta = after[len(before):]
        else:
            common = 0
            for a, b in zip(before, after):
                if a != b:
                    break
                common += 1
            delta = after[common:]
        self._prefix = self._read
        self._read = len(tokens)
        return delta


class StopMatcher:
    """Feed text as it is decoded; get the part that is safe to emit (held back while it may still
    begin a stop string, cut where one completes)."""

    __slots__ = ("stops", "include", "_held", "stopped", "matched")

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include_stop
        self._held = ""
        self.stopped = False
        # The stop string that ended the text (APIs that report which one, like Anthropic's).
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """The part of the text so far that is safe to emit; sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # The stop string completed first wins, as if text arrived a character at a
        # time (generation would have ended there); at equal ends, the longest.
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[0]):
                best = ((i + len(s), i), s)
        if best is not None:
            (_, i), s = best
            self.stopped = True
            self.matched = s
            self._held = ""
            return buf[: i + len(s)] if self.include else buf[:i]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, once generation ended without completing a stop string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = min(len(buf), max(len(s) for s in self.stops) - 1)
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
