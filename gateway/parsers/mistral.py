"""Mistral: ``[TOOL_CALLS]`` then either a JSON list of ``{"name", "arguments"}`` objects
(v3 tokenizers, ``mistral``) or ``name[ARGS]{...}`` per call (v11 and later: Mistral 3, ``mistral3``).

Both names read both forms; they differ in the form that required and named
tool choice are held to. ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens:
the gateway keeps them in the decoded text while this parser is in use.
"""

from __future__ import annotations

from mlxd.gateway.parsers.base import ToolParser, function_schema, json_term
from mlxd.gateway.parsers.json_calls import JsonCallObject
from mlxd.gateway.parsers.scanning import JsonEnd, Markers, drop

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_TOOL_CALLS, _ARGS = Markers(TOOL_CALLS), Markers(ARGS)
_LIST_SEPARATORS = ", \t\r\n"


class MistralToolParser(ToolParser):
    name = "mistral"
    special_markers = (TOOL_CALLS, ARGS)

    def __init__(self, tools=None):
        super().__init__(tools)
        # content | after (the marker) | name | args | between | list | item | done
        self._state = "content"
        self._json: JsonEnd | None = None
        self._obj: JsonCallObject | None = None

    def parse(self, final: bool) -> None:
        while True:
            state = self._state
            if state in ("content", "between"):
                if not self._stream_until(_TOOL_CALLS, final, self._content if state == "content" else drop):
                    return
                self._state = "after"
            elif state == "after":
                rest = self.buf.lstrip()
                self.meter.scanned += len(self.buf) - len(rest) + 1
                if not rest:
                    return
                self._take(len(self.buf) - len(rest))
                if rest[0] == "[":
                    self._take(1)
                    self._state = "list"
                else:
                    self._state = "name"
            elif state == "name":
                got = self._until(_ARGS, final)
                if got is None:
                    return
                if not got[1]:
                    self._state = "done"
                    continue
                self._call(got[0].strip())
                self._state, self._json = "args", JsonEnd(self.meter)
            elif state == "args":
                end = self._json.feed(self.buf)
                self._args(self._take(len(self.buf) if end is None else end))
                if end is None:
                    return
                self._state = "between"
            elif state == "list":
                rest = self.buf.lstrip(_LIST_SEPARATORS)
                self.meter.scanned += len(self.buf) - len(rest) + 1
                self._take(len(self.buf) - len(rest))
                if not rest:
                    return
                self._state = "item" if rest[0] == "{" else "done"
                self._obj = JsonCallObject(self)
            elif state == "item":
                end = self._obj.feed(self.buf)
                if end is None:
                    self._take(len(self.buf))
                    if final:
                        self._obj.close()
                    return
                self._take(end)
                self._state = "list"
            else:
                self._take(len(self.buf))
                return

    def grammar(self, tools, parallel, literal) -> str:
        item = {"anyOf": [function_schema(t) for t in tools]}
        schema = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return f"start: {literal(TOOL_CALLS)} {json_term(schema)}\n"


class Mistral3ToolParser(MistralToolParser):
    """Mistral 3 / Ministral 3 (tokenizer v11+): ``[TOOL_CALLS]name[ARGS]{...}``, the marker before each call."""

    name = "mistral3"

    def grammar(self, tools, parallel, literal) -> str:
        rules, names = [], []
        for i, t in enumerate(tools):
            f = t["function"]
            params = f.get("parameters") or {"type": "object"}
            rules.append(f'f{i}: {literal(TOOL_CALLS)} "{f["name"]}" {literal(ARGS)} {json_term(params)}')
            names.append(f"f{i}")
        more = " call*" if parallel else ""
        return "\n".join([f"start: call{more}", f"call: {' | '.join(names)}"] + rules) + "\n"
