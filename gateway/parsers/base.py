"""What every tool-call parser shares: the scan contract, streaming by difference, grammar pieces.

A parser's ``scan(text, final)`` reads the whole generated text so far and
says what is content and which tool calls it holds. The contract that makes
streaming safe: scanning a longer text never takes back what a shorter one
gave. Content only grows (text that might still become markup, such as a
trailing ``<tool_c``, is held back until it is known), calls only grow, and a
call's name, once given, is final, while its arguments only get longer.
``ToolStream`` then streams the difference between successive scans, so the
streamed result is by construction the non-streamed one.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable, ClassVar

log = logging.getLogger("mlxd.gateway.parsers")

# The JSON layout the grammars ask for: compact, one space after separators.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class Call:
    name: str
    arguments: str  # JSON text of the arguments object, as far as it is known


@dataclass
class Scan:
    content: str
    calls: list[Call] = field(default_factory=list)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def content_before(text: str, tag: str, final: bool) -> tuple[str, int]:
    """(content, index of ``tag`` or -1): text before the first ``tag``, holding back a partial tag unless final."""
    i = text.find(tag)
    if i >= 0:
        return text[:i], i
    if final:
        return text, -1
    return text[: len(text) - partial_suffix(text, tag)], -1


def json_value_end(text: str, start: int) -> int | None:
    """End index of the JSON value that begins at ``start`` (after optional whitespace); None if incomplete."""
    i, n = start, len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    if text[i] not in "{[":
        m = re.compile(r'"(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*|true|false|null').match(text, i)
        # A bare number is complete only once something follows it.
        if m is None or (m.end() == n and text[i] not in '"tfn'):
            return None
        return m.end()
    depth, in_str, esc = 0, False, False
    for j in range(i, n):
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def json_call(body: str, complete: bool) -> Call | None:
    """A call from ``{"name": ..., "arguments"|"parameters": {...}}`` text, streamed when the name comes first.

    Arguments are the model's own JSON text. A body in another key order is
    read only once ``complete``.
    """
    m = _NAME_FIRST.match(body)
    if m:
        name = json.loads(f'"{m.group(1)}"')
        end = json_value_end(body, m.end())
        return Call(name, (body[m.end(): end] if end is not None else body[m.end():]).strip())
    if not complete:
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def unparsed_as_content(text: str, content: str, calls: list[Call], final: bool) -> Scan:
    """Markup that never yielded a call is given back as content at the end, not lost.

    Safe for streaming: what was held back is only ever appended.
    """
    if final and not calls:
        return Scan(text)
    return Scan(content, calls)


class ToolParser:
    """One model family's tool-call format: reading it (``scan``) and constraining to it (``grammar``)."""

    name: ClassVar[str]
    # Markers the format uses that the tokenizer may hold as special tokens:
    # the gateway decodes them into the text when this parser is in use.
    special_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict] | None = None):
        # OpenAI tool objects ({"type": "function", "function": {...}}) of the request.
        self.tools = tools or []

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def grammar(self, tools: list[dict], parallel: bool, literal: Callable[[str], str]) -> str:
        """A Lark grammar (llguidance dialect) that admits exactly calls of ``tools`` in this format.

        ``literal`` turns a marker into the grammar's term for it (a special
        token reference when the tokenizer holds it as one).
        """
        raise NotImplementedError

    def parameters(self, name: str) -> dict:
        for t in self.tools:
            f = t.get("function", {})
            if f.get("name") == name:
                return f.get("parameters") or {}
        return {}


def function_schema(tool: dict, name_key: str = "name", args_key: str = "arguments") -> dict:
    """JSON schema of one call object ``{name_key: <const>, args_key: <parameters>}``, name first."""
    f = tool["function"]
    params = f.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {name_key: {"const": f["name"]}, args_key: params},
        "required": [name_key, args_key],
        "additionalProperties": False,
    }


def json_term(schema: dict) -> str:
    """A Lark term matching JSON that satisfies ``schema`` in the compact layout, objects closed."""
    return "%json " + json.dumps({**closed_objects(schema), "x-guidance": JSON_LAYOUT})


# Keywords whose value is a subschema a value must match, or a list or map of them. allOf
# parts (one object's properties split over parts) and negations are left as they are.
_SUB_ONE = ("items", "additionalProperties")
_SUB_LIST = ("anyOf", "oneOf", "prefixItems")
_SUB_MAP = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema):
    """``schema`` with every object that declares ``properties`` and says nothing of others closed to them.

    JSON Schema lets an object hold undeclared keys by default; a small model
    held to such a grammar invents keys until it runs out of tokens. Tool
    arguments default to the declared properties, as strict function calling
    does; a schema that sets ``additionalProperties`` (or ``patternProperties``)
    keeps its own choice.
    """
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUB_ONE:
        if isinstance(out.get(k), (dict, list)):
            out[k] = closed_objects(out[k])
    for k in _SUB_LIST:
        if isinstance(out.get(k), list):
            out[k] = [closed_objects(s) for s in out[k]]
    for k in _SUB_MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed_objects(s) for name, s in out[k].items()}
    if (isinstance(out.get("properties"), dict) and "additionalProperties" not in out
            and "patternProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


class ToolStream:
    """Streams one generation's tool calls and content as OpenAI deltas."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.sent: list[tuple[str, str]] = []  # (id, arguments sent) per call
        self.finished = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """Add generated text; returns (content delta, tool-call deltas in OpenAI's shape)."""
        self.text += delta
        scan = self.parser.scan(self.text, final)
        content = scan.content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(scan.content))
        deltas = []
        for i, call in enumerate(scan.calls):
            if i >= len(self.sent):
                # OpenAI's shape: the call's first delta names it, arguments follow in their own.
                cid = new_call_id()
                self.sent.append((cid, ""))
                deltas.append({"index": i, "id": cid, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            cid, sent = self.sent[i]
            if call.arguments == sent:
                continue
            if not call.arguments.startswith(sent):
                # A parser broke its contract: keep the stream consistent, drop the change.
                log.warning("%s parser took back arguments %r -> %r", self.parser.name, sent, call.arguments)
                continue
            deltas.append({"index": i, "function": {"arguments": call.arguments[len(sent):]}})
            self.sent[i] = (cid, call.arguments)
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """The end of generation: whatever was held back is decided now."""
        self.finished = True
        return self.feed("", final=True)

    @property
    def num_calls(self) -> int:
        return len(self.sent)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_complete(parser: ToolParser, text: str) -> tuple[str, list[dict]]:
    """Non-streaming: (content, tool_calls in OpenAI's message shape)."""
    scan = parser.scan(text, True)
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in scan.calls]
    return scan.content, calls
