"""``{"name": ..., "arguments"|"parameters": {...}}`` call objects read as they arrive (hermes, llama3_json,
mistral's JSON list).

A name-first object streams: the name once its key and value are in, then
the arguments as they come. An object in another key order can only be read
whole, once it ends (or its enclosing block does).
"""

from __future__ import annotations

import json
import re

from mlxd.gateway.parsers.scanning import JsonEnd

_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# A head longer than this is not a name-first head: the object is read whole instead.
HEAD_LIMIT = 512


class JsonCallObject:
    """One call object of ``parser``'s text; ``feed`` its pieces in order, ``close`` when its block ends."""

    def __init__(self, parser):
        self.parser = parser
        self.outer = JsonEnd(parser.meter)
        self.args: JsonEnd | None = None  # set once the head is known: the arguments stream
        self.head = ""
        self.whole: list[str] | None = None  # set when the object must be read whole
        self.closed = False

    def feed(self, piece: str) -> int | None:
        """Offset in ``piece`` just past the object's end (then it is closed), or None."""
        end = self.outer.feed(piece)
        part = piece if end is None else piece[:end]
        if self.args is not None:
            self._stream(part)
        elif self.whole is not None:
            self.whole.append(part)
        elif part:
            self.head += part
            self.parser.meter.scanned += len(self.head)
            m = _NAME_FIRST.match(self.head)
            name = _string(m.group(1)) if m else None
            if name is not None:
                self.parser._call(name)
                self.args = JsonEnd(self.parser.meter)
                rest, self.head = self.head[m.end():], ""
                self._stream(rest)
            elif m or len(self.head) > HEAD_LIMIT:
                self.whole, self.head = [self.head], ""
        if end is not None:
            self.close()
        return end

    def _stream(self, part: str) -> None:
        if self.args.done:
            return  # the rest of the object after its arguments (the closing brace)
        k = self.args.feed(part)
        self.parser._args(part if k is None else part[:k])

    def close(self) -> None:
        """The object's text is all in: one that did not stream is read whole now."""
        if self.closed:
            return
        self.closed = True
        if self.args is not None:
            return
        body = "".join(self.whole) if self.whole is not None else self.head
        self.parser.meter.scanned += len(body)
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return
        args = obj.get("arguments", obj.get("parameters", {}))
        self.parser._call(obj["name"])
        self.parser._args(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _string(body: str) -> str | None:
    """The JSON string literal ``"body"``; None when its escapes are invalid."""
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return None
