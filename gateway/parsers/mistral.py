"""Mistral: ``[TOOL_CALLS]`` then either a JSON list of ``{"name", "arguments"}`` objects
(v3 tokenizers) or ``name[ARGS]{...}`` per call (v11 and later).

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens: the gateway keeps them in
the decoded text while this parser is in use.
"""

from __future__ import annotations

from gateway.parsers.base import (Call, Scan, ToolParser, content_before, unparsed_as_content, function_schema, json_call, json_term,
                                  json_value_end)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    special_markers = (TOOL_CALLS, ARGS)

    def scan(self, text: str, final: bool) -> Scan:
        content, start = content_before(text, TOOL_CALLS, final)
        calls: list[Call] = []
        while start >= 0:
            pos = start + len(TOOL_CALLS)
            rest = text[pos:].lstrip()
            pos = len(text) - len(rest)
            if not rest:
                break
            if rest[0] == "[":
                self._json_list(text, pos + 1, final, calls)
                break
            arg_mark = text.find(ARGS, pos)
            if arg_mark < 0:
                break
            args_start = arg_mark + len(ARGS)
            end = json_value_end(text, args_start)
            calls.append(Call(text[pos:arg_mark].strip(), text[args_start: end or len(text)].strip()))
            if end is None:
                break
            start = text.find(TOOL_CALLS, end)
        return unparsed_as_content(text, content, calls, final)

    @staticmethod
    def _json_list(text: str, pos: int, final: bool, calls: list[Call]) -> None:
        while True:
            while pos < len(text) and text[pos] in ", \t\r\n":
                pos += 1
            if pos >= len(text) or text[pos] != "{":
                return
            end = json_value_end(text, pos)
            call = json_call(text[pos: end or len(text)], complete=end is not None or final)
            if call is not None:
                calls.append(call)
            if end is None:
                return
            pos = end

    def grammar(self, tools, parallel, literal) -> str:
        item = {"anyOf": [function_schema(t) for t in tools]}
        schema = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return f"start: {literal(TOOL_CALLS)} {json_term(schema)}\n"
