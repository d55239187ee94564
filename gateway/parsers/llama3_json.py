"""Llama 3.1 / 3.2 JSON tool calls: the whole reply is ``{"name": ..., "parameters": {...}}``,
optionally after ``<|python_tag|>``, several separated by ``;``.

A reply that does not open with ``{`` is plain content. Until the first
non-blank character arrives nothing can be said, so leading blanks are held.
"""

from __future__ import annotations

from gateway.parsers.base import (Scan, ToolParser, function_schema, json_call, json_term, json_value_end,
                                  unparsed_as_content)

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    special_markers = (TAG,)

    def scan(self, text: str, final: bool) -> Scan:
        rest = text.lstrip()
        if rest.startswith(TAG):
            rest = rest[len(TAG):].lstrip()
        elif TAG.startswith(rest) and rest and not final:
            return Scan("")
        if not rest:
            return Scan(text if final else "")
        if rest[0] != "{":
            return Scan(text)
        calls = []
        pos = 0
        while pos < len(rest) and rest[pos] == "{":
            end = json_value_end(rest, pos)
            call = json_call(rest[pos: end if end is not None else len(rest)], complete=end is not None or final)
            if call is not None:
                calls.append(call)
            if end is None:
                break
            pos = end
            while pos < len(rest) and rest[pos] in "; \t\r\n":
                pos += 1
        return unparsed_as_content(text, "", calls, final)

    def grammar(self, tools, parallel, literal) -> str:
        body = json_term({"anyOf": [function_schema(t, args_key="parameters") for t in tools]})
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {body}\n"
