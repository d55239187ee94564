"""Stop strings found across token boundaries, and never emitted.

Text that could still turn out to be the start of a stop string is held back
until the next tokens either complete the stop string (the request ends
there) or rule it out (the text is released).
"""

from __future__ import annotations


class StopMatcher:
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
