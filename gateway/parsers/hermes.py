"""Hermes / Qwen 2.5 / Qwen 3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call.

Content is the text before the first block; text between or after blocks is
the model's filler and is dropped, as the chat templates never put any there.
"""

from __future__ import annotations

from gateway.parsers.base import (Scan, ToolParser, content_before, function_schema, json_call, json_term,
                                  unparsed_as_content)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        content, start = content_before(text, OPEN, final)
        calls = []
        while start >= 0:
            body_start = start + len(OPEN)
            end = text.find(CLOSE, body_start)
            body = text[body_start: end if end >= 0 else len(text)]
            call = json_call(body, complete=end >= 0 or final)
            if call is not None:
                calls.append(call)
            if end < 0:
                break
            start = text.find(OPEN, end)
        return unparsed_as_content(text, content, calls, final)

    def grammar(self, tools, parallel, literal) -> str:
        body = json_term({"anyOf": [function_schema(t) for t in tools]})
        more = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{more}\n"
                f'call: {literal(OPEN)} "\\n" body "\\n" {literal(CLOSE)}\n'
                f"body: {body}\n")
