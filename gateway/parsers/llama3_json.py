"""Llama 3.1 / 3.2 JSON tool calls: the whole reply is ``{"name": ..., "parameters": {...}}``,
optionally after ``<|python_tag|>``, several separated by ``;``.

A reply that does not open with ``{`` is plain content. Until the first
non-blank character arrives nothing can be said, so leading blanks are held.
"""

from __future__ import annotations

from mlxd.gateway.parsers.base import ToolParser, function_schema, json_term
from mlxd.gateway.parsers.json_calls import JsonCallObject

TAG = "<|python_tag|>"
_SEPARATORS = "; \t\r\n"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    special_markers = (TAG,)

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "start"  # start | plain | sep | call | done
        self._obj: JsonCallObject | None = None

    def parse(self, final: bool) -> None:
        while True:
            if self._state == "start" and not self._start(final):
                return
            if self._state == "plain":
                self.meter.scanned += len(self.buf)
                self._content(self._take(len(self.buf)))
                return
            if self._state == "done":
                self._take(len(self.buf))
                return
            if self._state == "sep":
                rest = self.buf.lstrip(_SEPARATORS)
                self.meter.scanned += len(self.buf) - len(rest) + 1
                self._take(len(self.buf) - len(rest))
                if not rest:
                    return
                if rest[0] != "{":
                    self._state = "done"
                    continue
                self._state, self._obj = "call", JsonCallObject(self)
            end = self._obj.feed(self.buf)
            if end is None:
                self._take(len(self.buf))
                if final:
                    self._obj.close()
                return
            self._take(end)
            self._state = "sep"

    def _start(self, final: bool) -> bool:
        """Decide whether the reply is calls or content; False while it cannot be told yet."""
        lead = self.buf.lstrip()
        self.meter.scanned += len(self.buf)
        if lead.startswith(TAG):
            lead = lead[len(TAG):].lstrip()
        elif lead and TAG.startswith(lead) and not final:
            return False
        if not lead:
            return False  # at the end, the blanks are given back as content
        if lead[0] != "{":
            self._state = "plain"
            return True
        self._take(len(self.buf) - len(lead))
        self._state = "sep"
        return True

    def grammar(self, tools, parallel, literal) -> str:
        body = json_term({"anyOf": [function_schema(t, args_key="parameters") for t in tools]})
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {body}\n"
