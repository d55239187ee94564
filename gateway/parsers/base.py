"""What every tool-call parser shares: the incremental reading contract, streaming, grammar pieces.

A parser reads one generation's text as it arrives: ``feed(delta, final)``
returns only what the new text settled (content, a new call's name, more of
a call's arguments). Text that might still become markup, such as a
trailing ``<tool_c``, is held back until it is known; what was given is never
taken back. Each parser is a small state machine over ``buf``, the text not
yet settled (``scanning.Reader``), so a request costs time linear in its
output however finely it is streamed. Non-streaming is one feed of the whole
text, so the streamed result is the non-streamed one by construction.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from mlxd.gateway.parsers.scanning import JsonEnd, Markers, Reader, drop

# The JSON layout the grammars ask for: compact, one space after separators.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class CallDelta:
    index: int
    name: str | None  # on the call's first piece only
    arguments: str  # more of the JSON text of the arguments object


@dataclass
class Delta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolParser(Reader):
    """One model family's tool-call format: reading it (``feed``) and constraining to it (``grammar``).

    An instance reads one generation; ``fresh()`` gives another for the next.
    """

    name: ClassVar[str]
    # Markers the format uses that the tokenizer may hold as special tokens:
    # the gateway decodes them into the text when this parser is in use.
    special_markers: ClassVar[tuple[str, ...]] = ()
    # Markup that never yielded a call is given back as content at the end, not
    # lost (formats whose content is the text before the first call).
    give_back_unparsed: ClassVar[bool] = True

    def __init__(self, tools: list[dict] | None = None):
        # OpenAI tool objects ({"type": "function", "function": {...}}) of the request.
        self.tools = tools or []
        super().__init__()
        self.num_calls = 0
        self._out = Delta()
        self._raw: list[str] = []  # the text while no call is read: given back if none ever is
        self._content_len = 0
        self._args_begun = False
        self._args_hold = ""  # trailing blanks of the arguments, sent once more follows

    def fresh(self) -> "ToolParser":
        return type(self)(self.tools)

    def feed(self, text: str, final: bool = False) -> Delta:
        """Add generated text; returns the content and call pieces it settled (all, when ``final``)."""
        if self.num_calls == 0 and self.give_back_unparsed:
            self._raw.append(text)
        self.buf += text
        out = self._out = Delta()
        self.parse(final)
        if final:
            if self.num_calls == 0 and self.give_back_unparsed:
                self._content("".join(self._raw)[self._content_len:])
            self.buf = ""
        if self.num_calls:
            self._raw = []
        return out

    def parse(self, final: bool) -> None:
        """Settle as much of ``buf`` as is decided (all of it when ``final``)."""
        raise NotImplementedError

    def _next_piece(self, final: bool, opening: Markers, ends: dict[str, Markers], first: str
                    ) -> tuple[str, str, str] | None:
        """The common head of a block format's loop: outside a block ("content", or "between"
        blocks, whose text is dropped) stream up to ``opening`` and enter state ``first``; inside,
        (state, text, the marker that ends it, "" at the end) from ``ends[state]``. None: wait."""
        while self._state in ("content", "between"):
            sink = self._content if self._state == "content" else drop
            if not self._stream_until(opening, final, sink):
                return None
            self._state = first
        got = self._until(ends[self._state], final)
        return None if got is None else (self._state, *got)

    # -- what a state does with the text -------------------------------------------------------

    def _content(self, text: str) -> None:
        if text:
            self._out.content += text
            self._content_len += len(text)

    def _call(self, name: str) -> None:
        self._out.calls.append(CallDelta(self.num_calls, name, ""))
        self.num_calls += 1
        self._args_begun, self._args_hold = False, ""

    def _args(self, piece: str) -> None:
        """More argument text of the latest call; surrounding blanks are not part of the arguments."""
        text = self._args_hold + piece
        if not self._args_begun:
            text = text.lstrip()
        body = text.rstrip()
        self._args_hold = text[len(body):]
        if not body:
            return
        self._args_begun = True
        last = self._out.calls[-1] if self._out.calls else None
        if last is not None and last.index == self.num_calls - 1:
            last.arguments += body
        else:
            self._out.calls.append(CallDelta(self.num_calls - 1, None, body))

    # -- grammar -------------------------------------------------------------------------------

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
    """Streams one generation's tool calls and content as OpenAI deltas.

    A call list never holds the same call twice: a call equal to an earlier
    one (its name and the JSON value of its arguments) ends the list, and the
    text after it is not read (``ended``). A small model that may stop after
    any call often writes its last call again, and again, until max_tokens;
    a repeat adds nothing a client could act on. So that a repeat is never
    sent, every call after the first is held back until its arguments are
    complete (or the next call or the end of the text comes).
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser.fresh()
        self.ids: list[str] = []
        self.finished = False
        self.ended = False  # the list ended at a repeated call
        self._seen: set[tuple[str, str]] = set()  # the calls read, as (name, canonical arguments)
        self._name: str | None = None  # the call being read
        self._args: list[str] = []
        self._held: JsonEnd | None = None  # set while that call is held back: where its arguments end

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """Add generated text; returns (content delta, tool-call deltas in OpenAI's shape)."""
        if self.ended:
            return "", []
        got = self.parser.feed(delta, final)
        deltas: list[dict] = []
        for c in got.calls:
            if c.name is not None:
                if not self._settle(deltas):
                    return got.content, deltas
                self._name, self._args = c.name, []
                if self.ids:  # not the first call: held until it is known not to repeat one
                    self._held = JsonEnd(self.parser.meter)
                else:
                    self._send_name(deltas)
            if c.arguments:
                self._args.append(c.arguments)
                if self._held is None:
                    deltas.append({"index": len(self.ids) - 1, "function": {"arguments": c.arguments}})
                elif self._held.feed(c.arguments) is not None and not self._settle(deltas):
                    return got.content, deltas
        if final:
            self._settle(deltas)
        return got.content, deltas

    def _settle(self, deltas: list[dict]) -> bool:
        """The call being read is complete: note it, and send it if it was held. False: it was a repeat."""
        if self._name is None:
            return True
        text = "".join(self._args)
        try:
            key = json.dumps(json.loads(text), sort_keys=True)
        except (ValueError, RecursionError):
            key = text.strip()
        call = (self._name, key)
        if call in self._seen:
            self.ended = True
            return False
        self._seen.add(call)
        if self._held is not None:
            self._send_name(deltas)
            if text:
                deltas.append({"index": len(self.ids) - 1, "function": {"arguments": text}})
            self._held = None
        self._name = None
        return True

    def _send_name(self, deltas: list[dict]) -> None:
        # OpenAI's shape: the call's first delta names it, arguments follow in their own.
        self.ids.append(new_call_id())
        deltas.append({"index": len(self.ids) - 1, "id": self.ids[-1], "type": "function",
                       "function": {"name": self._name, "arguments": ""}})

    def finish(self) -> tuple[str, list[dict]]:
        """The end of generation: whatever was held back is decided now."""
        self.finished = True
        return self.feed("", final=True)

    @property
    def num_calls(self) -> int:
        return len(self.ids)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_complete(parser: ToolParser, text: str) -> tuple[str, list[dict]]:
    """Non-streaming: (content, tool_calls in OpenAI's message shape), what ``ToolStream`` streams."""
    content, deltas = ToolStream(parser).feed(text, final=True)
    calls: list[dict] = []
    for d in deltas:
        if "id" in d:
            calls.append({"id": d["id"], "type": "function", "function": {"name": d["function"]["name"],
                                                                          "arguments": ""}})
        calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content, calls
