"""Raw parameter text of the XML-style formats (qwen3_coder, glm45) as JSON, typed by the tool's schema."""

from __future__ import annotations

import ast
import json

from mlxd.gateway.parsers.base import json_term


def is_text(schema: dict) -> bool:
    """A string parameter: typed so, or an enum of strings with no type."""
    kind = schema.get("type")
    return kind == "string" or (kind is None and "enum" in schema and all(isinstance(e, str) for e in schema["enum"]))


def typed_value(raw: str, schema: dict):
    """Strings stay the raw text; other types are read as JSON, then as Python literals, else kept as text."""
    if is_text(schema):
        return raw
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        pass
    try:  # Python-style literals (True, 'x', [1, 2]) that models write for objects and lists
        return ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


def json_member(key: str, raw: str, schema: dict) -> str:
    """``"key": value`` of one parameter."""
    return f"{json.dumps(key)}: {json.dumps(typed_value(raw, schema), ensure_ascii=False)}"


def value_term(schema: dict) -> str:
    """The grammar term of one raw parameter value: free text for strings, JSON otherwise."""
    if is_text(schema) and "enum" not in schema:
        return "TEXT"
    if is_text(schema):
        return "(" + " | ".join(json.dumps(e) for e in schema["enum"]) + ")"
    return json_term(schema or {})


def function_rules(tools: list[dict], parameter, function) -> tuple[list[str], list[str]]:
    """Lark rules for formats that write each parameter as its own tagged piece: per tool, one rule
    per parameter (``parameter(name, schema)``'s body; optional unless required) and one for the
    call (``function(name, parts)``'s body). Returns (the rules, the call rules' names)."""
    rules, names = [], []
    for i, t in enumerate(tools):
        f = t["function"]
        params = f.get("parameters") or {}
        required = set(params.get("required", []))
        parts = []
        for j, (k, schema) in enumerate(params.get("properties", {}).items()):
            rules.append(f"p{i}_{j}: {parameter(k, schema)}")
            parts.append(f"p{i}_{j}" if k in required else f"p{i}_{j}?")
        rules.append(f"f{i}: {function(f['name'], ' '.join(parts))}")
        names.append(f"f{i}")
    return rules, names
