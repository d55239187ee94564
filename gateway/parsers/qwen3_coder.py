"""Qwen3-Coder XML tool calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text; they become JSON by the type the tool's schema
gives them (strings stay strings). Arguments stream one whole parameter at a
time: ``{"city": "Paris"`` then ``, "days": 3`` then ``}`` once the function closes.
"""

from __future__ import annotations

from mlxd.gateway.parsers.base import ToolParser
from mlxd.gateway.parsers.param_values import function_rules, json_member, value_term
from mlxd.gateway.parsers.scanning import Markers

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END, PARAM, PARAM_END = "<function=", "</function>", "<parameter=", "</parameter>"
_OPEN = Markers(OPEN)
# What each state reads up to.
_AFTER = {
    "block": Markers(FUNCTION, CLOSE),
    "function": Markers(">"),
    "body": Markers(PARAM, FUNCTION_END, CLOSE),
    "key": Markers(">"),
    "value": Markers(PARAM_END, FUNCTION_END, CLOSE),
    "tail": Markers(CLOSE),
}


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, tools=None):
        super().__init__(tools)
        # content | block | function | body | key | value | tail | between
        self._state = "content"
        self._types: dict = {}
        self._members = 0

    def parse(self, final: bool) -> None:
        while True:
            got = self._next_piece(final, _OPEN, _AFTER, "block")
            if got is None:
                return
            state, text, marker = got
            if state == "block":
                self._state = "function" if marker == FUNCTION else "between"
            elif state == "function":
                name = text.strip()
                if not marker:
                    return
                if not name or "\n" in name:
                    self._state = "block"
                    continue
                self._call(name)
                self._args("{")
                self._types, self._members = self.parameters(name).get("properties", {}), 0
                self._state = "body"
            elif state == "key" and marker:
                self._key = text.strip()
                self._state = "value"
            else:  # body, value, tail, or a key cut off by the end
                if state == "value" and marker == PARAM_END:
                    self._member(text)
                after = {PARAM: "key", PARAM_END: "body", FUNCTION_END: "tail"}.get(marker, "between")
                if state != "tail" and after in ("tail", "between"):
                    self._args("}")
                self._state = after
            if not marker:
                return

    def _member(self, text: str) -> None:
        raw = text[1:] if text.startswith("\n") else text
        raw = raw[:-1] if raw.endswith("\n") else raw
        sep = ", " if self._members else ""
        self._members += 1
        self._args(sep + json_member(self._key, raw, self._types.get(self._key, {})))

    def grammar(self, tools, parallel, literal) -> str:
        rules, names = function_rules(
            tools,
            lambda k, schema: f'"<parameter={k}>\\n" {value_term(schema)} "\\n</parameter>\\n"',
            lambda name, parts: f'"<function={name}>\\n" {parts} "</function>\\n"')
        more = ' ("\\n" call)*' if parallel else ""
        head = [f"start: call{more}", f'call: {literal(OPEN)} "\\n" ({" | ".join(names)}) {literal(CLOSE)}']
        return "\n".join(head + rules + ["TEXT: /[^<\\n]+/"]) + "\n"
