"""GLM-4.5 / 4.6 / 4.7 tool calls, as the chat template writes them::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value></tool_call>

(GLM-4.7 drops the newlines; blanks between the parts are allowed). Values are
raw text, typed by the tool's schema as in qwen3_coder; arguments stream one
whole parameter at a time. Reasoning is ``<think>…</think>`` (the ``glm45``
reasoning parser, the same as ``think``).
"""

from __future__ import annotations

from mlxd.gateway.parsers.base import ToolParser
from mlxd.gateway.parsers.param_values import function_rules, json_member, value_term
from mlxd.gateway.parsers.scanning import Markers

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_OPEN = Markers(OPEN)
# What each state reads up to.
_AFTER = {
    "name": Markers(KEY, "\n", CLOSE),
    "args": Markers(KEY, CLOSE),
    "key": Markers(KEY_END, CLOSE),
    "value_open": Markers(VALUE, KEY, CLOSE),
    "value": Markers(VALUE_END, CLOSE),
}


class Glm45ToolParser(ToolParser):
    name = "glm45"
    special_markers = (OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END)

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "content"  # content | name | args | key | value_open | value | between
        self._types: dict = {}
        self._members = 0
        self._key = ""

    def parse(self, final: bool) -> None:
        while True:
            got = self._next_piece(final, _OPEN, _AFTER, "name")
            if got is None:
                return
            state, text, marker = got
            if state == "name":
                name = text.strip()
                if not name:
                    if marker != "\n":  # a block without a name holds no call
                        self._state = "between"
                        if not marker:
                            return
                    continue
                self._call(name)
                self._args("{")
                self._types, self._members = self.parameters(name).get("properties", {}), 0
            elif state == "key" and marker == KEY_END:
                self._key = text.strip()
                self._state = "value_open"
                continue
            elif state == "value" and marker == VALUE_END:
                sep = ", " if self._members else ""
                self._members += 1
                self._args(sep + json_member(self._key, text, self._types.get(self._key, {})))
                self._state = "args"
                continue
            if marker == KEY:
                self._state = "key"
            elif marker in (CLOSE, ""):
                self._args("}")
                self._state = "between"
                if not marker:
                    return
            else:
                self._state = "value" if marker == VALUE else "args"

    def grammar(self, tools, parallel, literal) -> str:
        rules, names = function_rules(
            tools,
            lambda k, schema: (f'"\\n" {literal(KEY)} "{k}" {literal(KEY_END)} "\\n" {literal(VALUE)} '
                               f'{value_term(schema)} {literal(VALUE_END)}'),
            lambda name, parts: f'"{name}" {parts}')
        more = ' ("\\n" call)*' if parallel else ""
        head = [f"start: call{more}", f'call: {literal(OPEN)} ({" | ".join(names)}) {literal(CLOSE)}']
        return "\n".join(head + rules + ["TEXT: /[^<]+/"]) + "\n"
