"""OpenAI's harmony format (gpt-oss): messages on channels, reasoning and tool calls among them::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}
    <|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(shown on several lines; the text has no line breaks between the parts).
The prompt ends with ``<|start|>assistant``, so the first message opens at
its channel. ``analysis`` is reasoning, ``final`` (and ``commentary`` without a
recipient, the preamble a model may show) is content, and a message with a
recipient ``to=functions.NAME`` is a call whose body is the JSON arguments.
``<|call|>`` and ``<|return|>`` are end-of-generation tokens, so a message
may end with the text instead.

The reasoning parser runs first and hands the tool parser the content as
plain text and call messages as they were; the tool parser reads either
that or the raw text (then analysis, with no reasoning parser to take it, is
left out of the content).
"""

from __future__ import annotations

import json
import re

from mlxd.gateway.parsers.base import ToolParser, json_term
from mlxd.gateway.parsers.reasoning import ReasoningParser
from mlxd.gateway.parsers.scanning import Markers, Reader

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_OUTSIDE = Markers(START, CHANNEL, END, CALL, RETURN)
_HEADER_END = Markers(MESSAGE)
_BODY_END = Markers(END, CALL, RETURN, START)
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)


class HarmonyMessages(Reader):
    """Splits harmony text into messages as it arrives; subclasses say where each part goes."""

    def __init__(self) -> None:
        super().__init__()
        self._frame = "outside"  # outside | header | body
        self._header = ""

    def outside(self, text: str) -> None:
        """Text outside any message (plain content)."""

    def begin(self, header: str, channel: str, recipient: str | None) -> None:
        """A message's header is complete; its body follows."""

    def body(self, text: str) -> None:
        """More of the current message's body."""

    def end(self, marker: str) -> None:
        """The current message ended with ``marker`` ("" at the end of the text)."""

    def parse(self, final: bool) -> None:
        while True:
            if self._frame == "outside":
                marker = self._stream_until(_OUTSIDE, final, self.outside)
                if not marker:
                    return
                if marker in (START, CHANNEL):  # a stray end marker outside a message is dropped
                    self._frame, self._header = "header", "" if marker == START else CHANNEL
            elif self._frame == "header":
                got = self._until(_HEADER_END, final)
                if got is None:
                    return
                header = self._header + got[0]
                self.meter.scanned += len(header)
                channel = _CHANNEL_NAME.search(header)
                recipient = _RECIPIENT.search(header)
                self.begin(header, channel.group(1) if channel else "", recipient.group(1) if recipient else None)
                if not got[1]:
                    self.end("")
                    return
                self._frame = "body"
            else:
                marker = self._stream_until(_BODY_END, final, self.body)
                if marker is None:
                    return
                self.end(marker)
                self._frame, self._header = ("header", "") if marker == START else ("outside", "")
                if not marker:
                    return


class HarmonyReasoningParser(HarmonyMessages, ReasoningParser):
    """Analysis to reasoning; final and preamble bodies to content as plain text; calls passed on whole."""

    name = "harmony"
    special_markers = MARKERS

    def __init__(self, starts_inside: bool = False):
        super().__init__()
        self._to = "content"  # where the current body goes: reasoning | content | call

    def fresh(self) -> "HarmonyReasoningParser":
        return type(self)()

    @classmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        return False  # the model picks its channel itself

    def outside(self, text):
        self._content.append(text)

    def begin(self, header, channel, recipient):
        if recipient is not None:
            self._to = "call"
            self._content.append(START + header + MESSAGE)
        else:
            self._to = "reasoning" if channel == "analysis" else "content"

    def body(self, text):
        (self._reasoning if self._to == "reasoning" else self._content).append(text)

    def end(self, marker):
        if self._to == "call" and marker != START:
            self._content.append(marker)


class HarmonyToolParser(ToolParser, HarmonyMessages):
    name = "harmony"
    special_markers = MARKERS
    give_back_unparsed = False  # content is the final channel, not a prefix of the text
    parse = HarmonyMessages.parse

    def __init__(self, tools=None):
        super().__init__(tools)
        self._to = "content"  # content | call | drop

    def outside(self, text):
        self._content(text)

    def begin(self, header, channel, recipient):
        if recipient is not None:
            self._to = "call"
            self._call(recipient.removeprefix("functions."))
        else:
            self._to = "drop" if channel == "analysis" else "content"

    def body(self, text):
        if self._to == "call":
            self._args(text)
        elif self._to == "content":
            self._content(text)

    def grammar(self, tools, parallel, literal) -> str:
        # One call per turn: <|call|> ends the generation. Reasoning may come first.
        calls, rules = [], []
        for i, t in enumerate(tools):
            f = t["function"]
            params = f.get("parameters") or {"type": "object"}
            rules.append(f'f{i}: {literal(CHANNEL)} {json.dumps("commentary to=functions." + f["name"] + " ")} '
                         f'{literal(CONSTRAIN)} "json" {literal(MESSAGE)} {json_term(params)} {literal(CALL)}')
            calls.append(f"f{i}")
        head = ["start: analysis? call", f"call: {' | '.join(calls)}",
                f'analysis: {literal(CHANNEL)} "analysis" {literal(MESSAGE)} thought {literal(START)} "assistant"',
                f"thought[lazy]: /(?s:.*)/ {literal(END)}"]
        return "\n".join(head + rules) + "\n"
