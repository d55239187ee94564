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

import ast
import json
import re

from gateway.parsers.base import (Call, Scan, ToolParser, content_before, json_term, unparsed_as_content)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def scan(self, text: str, final: bool) -> Scan:
        content, start = content_before(text, OPEN, final)
        calls: list[Call] = []
        while start >= 0:
            end = text.find(CLOSE, start)
            block = text[start: end if end >= 0 else len(text)]
            call = self._call(block, closed=end >= 0 or final)
            if call is not None:
                calls.append(call)
            if end < 0:
                break
            start = text.find(OPEN, end)
        return unparsed_as_content(text, content, calls, final)

    def _call(self, block: str, closed: bool) -> Call | None:
        m = _FUNCTION.search(block)
        if m is None:
            return None
        name = m.group(1).strip()
        body_end = block.find("</function>", m.end())
        body = block[m.end(): body_end if body_end >= 0 else len(block)]
        types = self.parameters(name).get("properties", {})
        parts = [f"{json.dumps(k.strip())}: {json.dumps(self._value(v, types.get(k.strip(), {})), ensure_ascii=False)}"
                 for k, v in _PARAM.findall(body)]
        done = body_end >= 0 or closed
        return Call(name, "{" + ", ".join(parts) + ("}" if done else ""))

    @staticmethod
    def _value(raw: str, schema: dict):
        kind = schema.get("type")
        if kind == "string" or (kind is None and "enum" in schema and all(isinstance(e, str) for e in schema["enum"])):
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            pass
        try:  # Python-style literals (True, 'x', [1, 2]) that models write for objects and lists
            return ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return raw

    def grammar(self, tools, parallel, literal) -> str:
        rules, names = [], []
        for i, t in enumerate(tools):
            f = t["function"]
            params = f.get("parameters") or {}
            props = params.get("properties", {})
            required = set(params.get("required", []))
            parts = []
            for j, (k, schema) in enumerate(props.items()):
                rule = f"p{i}_{j}"
                rules.append(f'{rule}: "<parameter={k}>\\n" {self._value_term(schema)} "\\n</parameter>\\n"')
                parts.append(rule if k in required else f"{rule}?")
            rules.append(f'f{i}: "<function={f["name"]}>\\n" {" ".join(parts)} "</function>\\n"')
            names.append(f"f{i}")
        more = ' ("\\n" call)*' if parallel else ""
        head = [f"start: call{more}", f'call: {literal(OPEN)} "\\n" ({" | ".join(names)}) {literal(CLOSE)}']
        return "\n".join(head + rules + ["TEXT: /[^<\\n]+/"]) + "\n"

    @staticmethod
    def _value_term(schema: dict) -> str:
        kind = schema.get("type")
        if kind == "string" and "enum" not in schema:
            return "TEXT"
        if kind == "string":
            return "(" + " | ".join(json.dumps(e) for e in schema["enum"]) + ")"
        return json_term(schema or {})
