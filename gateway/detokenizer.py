"""Token ids to text, one step at a time, without splitting multi-byte characters.

A token of a byte-level vocabulary may carry only part of a UTF-8 character
(an emoji is often three tokens). Decoding the new tokens alone would emit
U+FFFD for each part. Instead each step decodes a short window of recent
tokens twice, with and without the new ones, and emits the difference only
once it no longer ends in an incomplete character. The window starts a few
tokens back so that tokenizers that strip a leading space at the start of a
decode (SentencePiece) still produce the space.
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
