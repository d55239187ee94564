"""Gemma 4 tool calls: ``<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>``.

Keys are bare words and strings sit between ``<|"|>`` delimiters; numbers,
booleans and nested objects and lists are otherwise JSON. The arguments are
rewritten into JSON as they stream (a key is sent once its colon arrives, a
string as it grows). Reasoning is ``<|channel>thought …<channel|>`` (the
``gemma4`` reasoning parser).
"""

from __future__ import annotations

import json
import re

from mlxd.gateway.parsers.base import ToolParser, json_term
from mlxd.gateway.parsers.param_values import is_text
from mlxd.gateway.parsers.scanning import Markers, Meter, drop, partial_suffix

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_OPEN = Markers(OPEN)
_HEAD = Markers("{", CLOSE)
_WORD = re.compile(r"[A-Za-z_][\w-]*")
_PLAIN = re.compile(r'[^{}\[\],"<A-Za-z_]+')
_JSON_STRING_END = re.compile(r'["\\]')


class GemmaArguments:
    """Gemma's argument object rewritten into JSON as it arrives; ``feed`` returns (JSON text, end or None)."""

    def __init__(self, meter: Meter):
        # Fed from just after the object's opening brace.
        self.meter = meter
        self.stack: list[str] = ["{"]
        self.key_next = True  # a bare word here is a key
        self.in_quote = False  # inside <|"|> … <|"|>
        self.in_json_string = False
        self.esc = False

    def feed(self, text: str, final: bool) -> tuple[str, int | None, int]:
        """(JSON for the settled part, offset past the object's end or None, characters settled)."""
        out, i, n = [], 0, len(text)
        while i < n:
            if self.in_quote:
                j = text.find(QUOTE, i)
                stop = j if j >= 0 else (n if final else n - partial_suffix(text[i:], QUOTE))
                out.append(json.dumps(text[i:stop], ensure_ascii=False)[1:-1])
                self.meter.scanned += stop - i
                if j < 0:
                    return "".join(out), None, stop
                out.append('"')
                self.in_quote, i = False, j + len(QUOTE)
                continue
            if self.in_json_string:
                if self.esc:
                    out.append(text[i])
                    self.esc, i = False, i + 1
                    continue
                m = _JSON_STRING_END.search(text, i)
                stop = m.end() if m else n
                out.append(text[i:stop])
                self.meter.scanned += stop - i
                if m and m.group() == "\\":
                    self.esc = True
                elif m:
                    self.in_json_string = False
                i = stop
                continue
            m = _PLAIN.match(text, i)
            if m:
                out.append(m.group())
                self.meter.scanned += m.end() - i
                i = m.end()
                continue
            c = text[i]
            self.meter.scanned += 1
            if c == "<":
                if text.startswith(QUOTE, i):
                    out.append('"')
                    self.in_quote, self.key_next, i = True, False, i + len(QUOTE)
                    continue
                if not final and QUOTE.startswith(text[i:]):
                    return "".join(out), None, i  # perhaps a delimiter: wait for the rest
                out.append(c)
            elif c.isalpha() or c == "_":
                w = _WORD.match(text, i)
                if w.end() == n and not final:
                    return "".join(out), None, i  # the word may go on
                word, i = w.group(), w.end()
                out.append(json.dumps(word) if self.key_next else word)
                self.key_next = False
                continue
            elif c == '"':
                out.append(c)
                self.in_json_string, self.key_next = True, False
            elif c in "{[":
                self.stack.append(c)
                self.key_next = c == "{"
                out.append(c)
            elif c in "}]":
                out.append(c)
                if self.stack:
                    self.stack.pop()
                if not self.stack:
                    return "".join(out), i + 1, i + 1
            elif c == ",":
                out.append(c)
                self.key_next = bool(self.stack) and self.stack[-1] == "{"
            i += 1
        return "".join(out), None, n


class Gemma4ToolParser(ToolParser):
    name = "gemma4"
    special_markers = (OPEN, CLOSE, QUOTE)

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "content"  # content | head | args | between
        self._conv: GemmaArguments | None = None

    def parse(self, final: bool) -> None:
        while True:
            state = self._state
            if state in ("content", "between"):
                if not self._stream_until(_OPEN, final, self._content if state == "content" else drop):
                    return
                self._state = "head"
            elif state == "head":
                got = self._until(_HEAD, final)
                if got is None:
                    return
                head, marker = got
                name = head.strip().lstrip(",").strip()
                if marker != "{" or not name.startswith("call:") or not name[5:].strip():
                    self._state = "between"  # the block holds no (further) call
                    if not marker:
                        return
                    continue
                self._call(name[5:].strip())
                self._conv = GemmaArguments(self.meter)
                self._args("{")
                self._state = "args"
            else:
                text, end, used = self._conv.feed(self.buf, final)
                self._take(used)
                self._args(text)
                if end is None:
                    return
                self._state = "head"  # another call may follow in the same block

    def grammar(self, tools, parallel, literal) -> str:
        rules, names = [], []
        for i, t in enumerate(tools):
            f = t["function"]
            params = f.get("parameters") or {}
            props = params.get("properties", {})
            # The chat template writes a call's keys sorted; the model learned them so.
            required = sorted(k for k in props if k in set(params.get("required", [])))
            args = ' "," '.join(f'"{k}:" {_value_term(props[k], literal)}' for k in required)
            rules.append(f'f{i}: "call:{f["name"]}{{" {args} "}}"')
            names.append(f"f{i}")
        more = " call*" if parallel else ""
        head = [f"start: call{more}", f"call: {literal(OPEN)} ({' | '.join(names)}) {literal(CLOSE)}"]
        return "\n".join(head + rules + ['TEXT: /[^<]*/']) + "\n"


def _value_term(schema: dict, literal) -> str:
    if is_text(schema) and "enum" not in schema:
        return f"{literal(QUOTE)} TEXT {literal(QUOTE)}"
    if is_text(schema):
        return "(" + " | ".join(f"{literal(QUOTE)} {json.dumps(e)} {literal(QUOTE)}" for e in schema["enum"]) + ")"
    return json_term(schema)
