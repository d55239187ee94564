"""Incremental text scanning for the parsers: marker search with a held-back tail, and JSON value ends.

Every scanner here examines each character of the generated text a bounded
number of times however the text is cut into deltas: what it has read it
either hands on or keeps as state, never reads again. ``Meter`` counts the
characters examined, so a test can prove the bound instead of timing it.
"""

from __future__ import annotations

import re
from typing import Callable


class Meter:
    """Characters examined by one parser's scanners (instrumentation for the linear-work guarantee)."""

    __slots__ = ("scanned",)

    def __init__(self) -> None:
        self.scanned = 0


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def drop(text: str) -> None:
    """A sink for text a format leaves out (filler between calls)."""


class Reader:
    """Text received and not yet settled (``buf``), read by a parser's states.

    Every state either hands the text it read on or keeps it as state, so each
    character is examined a bounded number of times; ``meter`` counts them.
    """

    def __init__(self) -> None:
        self.meter = Meter()
        self.buf = ""
        self._collected: list[str] = []

    def _take(self, n: int) -> str:
        head, self.buf = self.buf[:n], self.buf[n:]
        return head

    def _until(self, markers: Markers, final: bool) -> tuple[str, str] | None:
        """(text before the first of ``markers``, the marker), both consumed; None while it has not come.

        The text is collected across feeds without being read again. At the
        end of the text without the marker: (all of it, "").
        """
        i, marker = markers.find(self.buf, self.meter)
        if i < 0 and not final:
            keep = markers.held(self.buf, self.meter)
            self._collected.append(self._take(len(self.buf) - keep))
            return None
        if i < 0:
            i = len(self.buf)
        text = "".join(self._collected) + self._take(i)
        self._take(len(marker))
        self._collected = []
        return text, marker

    def _stream_until(self, markers: Markers, final: bool, sink: Callable[[str], object]) -> str | None:
        """Hand text to ``sink`` up to the first of ``markers``; the marker once it comes ("" at the end)."""
        i, marker = markers.find(self.buf, self.meter)
        if i < 0:
            n = len(self.buf) if final else len(self.buf) - markers.held(self.buf, self.meter)
            sink(self._take(n))
            return "" if final else None
        sink(self._take(i))
        self._take(len(marker))
        return marker


class Markers:
    """The first of several markers in a text, and how much of its end might still begin one."""

    def __init__(self, *markers: str):
        self.markers = markers
        self._re = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
        self.longest = max(len(m) for m in markers)

    def find(self, text: str, meter: Meter) -> tuple[int, str]:
        """(index, marker) of the first marker in ``text``, or (-1, "")."""
        m = self._re.search(text)
        meter.scanned += len(text) if m is None else m.end()
        return (m.start(), m.group()) if m else (-1, "")

    def held(self, text: str, meter: Meter) -> int:
        """How many end characters of ``text`` could begin a marker (only the last few are looked at)."""
        meter.scanned += min(len(text), self.longest)
        return max(partial_suffix(text, m) for m in self.markers)


_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'[{}\[\]"]')
_SCALAR_END = re.compile(r"[^0-9A-Za-z.+\-]")


class JsonEnd:
    """Finds where one JSON value ends in text that arrives in pieces.

    ``feed(piece)`` returns the offset in ``piece`` just past the value's end,
    or None while it has not ended; state carries over between pieces, so each
    character is read once. Leading blanks are skipped. A bare scalar (a
    number, ``true``) ends at the first character that cannot continue it,
    which is why a number at the very end of the text stays unfinished.
    """

    def __init__(self, meter: Meter):
        self.meter = meter
        self.kind = ""  # "" before the value, then "{" (containers), '"' (a bare string) or "s" (scalar)
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.done = False

    def feed(self, piece: str) -> int | None:
        if self.done:
            return 0
        i, n = 0, len(piece)
        if not self.kind:
            while i < n and piece[i] in " \t\r\n":
                i += 1
            if i == n:
                self.meter.scanned += n
                return None
            c = piece[i]
            self.kind = "{" if c in "{[" else '"' if c == '"' else "s"
            if self.kind == '"':
                self.in_str, i = True, i + 1
        start = i
        end = self._scan(piece, i)
        self.meter.scanned += (n if end is None else end) - start
        if end is not None:
            self.done = True
        return end

    def _scan(self, piece: str, i: int) -> int | None:
        n = len(piece)
        if self.kind == "s":
            m = _SCALAR_END.search(piece, i)
            return m.start() if m else None
        while i < n:
            if self.esc:
                self.esc, i = False, i + 1
                continue
            if self.in_str:
                m = _IN_STRING.search(piece, i)
                if m is None:
                    return None
                i = m.end()
                if m.group() == "\\":
                    self.esc = True
                else:
                    self.in_str = False
                    if self.kind == '"':
                        return i
                continue
            m = _OUTSIDE.search(piece, i)
            if m is None:
                return None
            c, i = m.group(), m.end()
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i
        return None
