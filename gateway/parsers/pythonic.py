"""Pythonic tool calls (Llama 3.2 / 4 and others): ``[get_weather(city="Paris"), now()]``.

A reply opening with ``[`` and a call is a list of calls; anything else is
content. Each call is read with ``ast`` once its closing parenthesis arrives,
so a call streams as its name (as soon as the ``(`` is seen) and then its
whole arguments.
"""

from __future__ import annotations

import ast
import json
import re

from mlxd.gateway.parsers.base import ToolParser, json_term

START = "<|python_start|>"
_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_MAYBE = re.compile(r"\[\s*([A-Za-z_][\w.]*\s*)?$")
_PARTIAL_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*\s*)?$")
# JSON spellings a model may use inside Python calls.
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.AST):
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


class PythonicToolParser(ToolParser):
    name = "pythonic"
    special_markers = (START,)

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "start"  # start | plain | head | body | sep | done
        self._src: list[str] = []
        self._end: CallEnd | None = None

    def parse(self, final: bool) -> None:
        while True:
            if self._state == "start" and not self._start(final):
                return
            state = self._state
            if state == "plain":
                self.meter.scanned += len(self.buf)
                self._content(self._take(len(self.buf)))
                return
            if state == "done":
                self._take(len(self.buf))
                return
            if state == "sep":
                rest = self.buf.lstrip(", \t\r\n")
                self.meter.scanned += len(self.buf) - len(rest) + 1
                self._take(len(self.buf) - len(rest))
                if not rest:
                    return
                self._state = "head"
            elif state == "head":
                self.meter.scanned += len(self.buf)
                m = _HEAD.match(self.buf)
                if m is None:
                    if final or not _PARTIAL_HEAD.match(self.buf):
                        self._state = "done"
                        continue
                    return
                self._call(m.group(1))
                self._src, self._end = [self._take(m.end())], CallEnd(self.meter)
                self._state = "body"
            elif state == "body":
                end = self._end.feed(self.buf)
                self._src.append(self._take(len(self.buf) if end is None else end))
                if end is None:
                    return
                self._args(_arguments("".join(self._src)) or "")
                self._state = "sep"

    def _start(self, final: bool) -> bool:
        """Decide whether the reply is a call list; False while it cannot be told yet."""
        self.meter.scanned += len(self.buf)
        rest = self.buf.lstrip()
        if rest.startswith(START):
            rest = rest[len(START):].lstrip()
        elif START.startswith(rest) and rest and not final:
            return False
        if not final and (not rest or _MAYBE.match(rest)):
            return False  # not yet known whether this is a call list
        if not rest.startswith("[") or not _HEAD.match(rest, 1):
            self._state = "plain"
            return True
        self._take(len(self.buf) - len(rest) + 1)
        self._state = "head"
        return True

    def grammar(self, tools, parallel, literal) -> str:
        rules, names = [], []
        for i, t in enumerate(tools):
            f = t["function"]
            params = f.get("parameters") or {}
            props = params.get("properties", {})
            required = [k for k in props if k in set(params.get("required", []))]
            args = ' ", " '.join(f'"{k}=" {json_term(props[k])}' for k in required)
            rules.append(f'f{i}: "{f["name"]}(" {args} ")"')
            names.append(f"f{i}")
        more = ' (", " call)*' if parallel else ""
        return "\n".join([f'start: "[" call{more} "]"', f"call: {' | '.join(names)}"] + rules) + "\n"


_PY_OUTSIDE = re.compile(r"[\"'()\[\]{}]")
_IN_QUOTE = {'"': re.compile(r'["\\]'), "'": re.compile(r"['\\]")}


class CallEnd:
    """Where a call's argument list closes, in text that arrives in pieces (brackets and quotes counted)."""

    def __init__(self, meter):
        self.meter = meter
        self.depth, self.quote, self.esc = 1, "", False

    def feed(self, piece: str) -> int | None:
        """Offset in ``piece`` just past the ``)`` that closes the call, or None."""
        i, n = 0, len(piece)
        while i < n:
            if self.esc:
                self.esc, i = False, i + 1
            elif self.quote:
                m = _IN_QUOTE[self.quote].search(piece, i)
                if m is None:
                    break
                if m.group() == "\\":
                    self.esc = True
                else:
                    self.quote = ""
                i = m.end()
            else:
                m = _PY_OUTSIDE.search(piece, i)
                if m is None:
                    break
                c, i = m.group(), m.end()
                if c in "\"'":
                    self.quote = c
                elif c in "([{":
                    self.depth += 1
                else:
                    self.depth -= 1
                    if self.depth == 0:
                        self.meter.scanned += i
                        return i
        self.meter.scanned += n
        return None


def _arguments(src: str) -> str | None:
    try:
        node = ast.parse(src.strip(), mode="eval").body
        if not isinstance(node, ast.Call):
            return None
        return json.dumps({kw.arg: _literal(kw.value) for kw in node.keywords}, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
