"""Hermes / Qwen 2.5 / Qwen 3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call.

Content is the text before the first block; text between or after blocks is
the model's filler and is dropped, as the chat templates never put any there.
"""

from __future__ import annotations

from mlxd.gateway.parsers.base import ToolParser, function_schema, json_term
from mlxd.gateway.parsers.json_calls import JsonCallObject
from mlxd.gateway.parsers.scanning import Markers, drop

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_OPEN, _CLOSE = Markers(OPEN), Markers(CLOSE)


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "content"  # content | call | between
        self._obj: JsonCallObject | None = None

    def parse(self, final: bool) -> None:
        while True:
            if self._state != "call":
                sink = self._content if self._state == "content" else drop
                if not self._stream_until(_OPEN, final, sink):
                    return
                self._state, self._obj = "call", JsonCallObject(self)
            else:
                marker = self._stream_until(_CLOSE, final, self._obj.feed)
                if marker is None:
                    return
                self._obj.close()
                self._state = "between"
                if not marker:
                    return

    def grammar(self, tools, parallel, literal) -> str:
        # The list may end after any call, and the last call's closing marker may be left out: a
        # model that has not learned the format ends its call with its JSON (and, given a closing
        # marker, goes on to a newline and so to another call); the parser reads either end.
        body = json_term({"anyOf": [function_schema(t) for t in tools]})
        more = '(call "\\n")* ' if parallel else ""
        return (f"start: {more}last\n"
                f'call: {literal(OPEN)} "\\n" body "\\n" {literal(CLOSE)}\n'
                f'last: {literal(OPEN)} "\\n" body ("\\n" {literal(CLOSE)})?\n'
                f"body: {body}\n")
