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

from gateway.parsers.base import Call, Scan, ToolParser, json_term, unparsed_as_content

START = "<|python_start|>"
_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_MAYBE = re.compile(r"\[\s*([A-Za-z_][\w.]*\s*)?$")
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

    def scan(self, text: str, final: bool) -> Scan:
        rest = text.lstrip()
        if rest.startswith(START):
            rest = rest[len(START):].lstrip()
        elif START.startswith(rest) and rest and not final:
            return Scan("")
        if not final and (not rest or _MAYBE.match(rest)):
            return Scan("")  # not yet known whether this is a call list
        if not rest.startswith("[") or not _HEAD.match(rest, 1):
            return Scan(text)
        calls: list[Call] = []
        pos = 1
        while True:
            m = _HEAD.match(rest, pos)
            if m is None:
                break
            end = _call_end(rest, m.end())
            if end is None:
                calls.append(Call(m.group(1), ""))
                break
            calls.append(Call(m.group(1), _arguments(rest[m.start(): end]) or ""))
            pos = end
            while pos < len(rest) and rest[pos] in ", \t\r\n":
                pos += 1
        return unparsed_as_content(text, "", calls, final)

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


def _call_end(text: str, pos: int) -> int | None:
    """Index after the ``)`` closing a call whose ``(`` ends just before ``pos``."""
    depth, quote, esc = 1, "", False
    for j in range(pos, len(text)):
        c = text[j]
        if quote:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _arguments(src: str) -> str | None:
    try:
        node = ast.parse(src.strip(), mode="eval").body
        if not isinstance(node, ast.Call):
            return None
        return json.dumps({kw.arg: _literal(kw.value) for kw in node.keywords}, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError):
        return None
