"""One chat choice's text split into reasoning, content and tool calls, whole or as deltas.

Reasoning is split off first (``<think>…</think>``); what remains goes to the
tool-call parser. Both read incrementally, and non-streaming is one feed of
the whole text, so a streamed choice adds up to exactly the non-streamed one.
"""

from __future__ import annotations

from gateway.parsers import REASONING_PARSERS, ReasoningStream, ToolParser, ToolStream, parse_complete


class ChatOutput:
    """Splits one choice; ``feed`` per streamed text delta, ``finish`` at its end, or ``whole`` at once."""

    def __init__(self, reasoning_parser: str | None, prompt_text: str, tool_parser: ToolParser | None):
        self.reasoning = None
        if reasoning_parser:
            cls = REASONING_PARSERS[reasoning_parser]
            self.reasoning = cls(starts_inside=cls.prompt_opens_reasoning(prompt_text))
        self.tool_parser = tool_parser
        self._rstream = ReasoningStream(self.reasoning) if self.reasoning else None
        self._tstream = ToolStream(tool_parser) if tool_parser else None
        # The choice's finish_reason once read whole (tool_calls when it called tools).
        self.final_reason: str | None = None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_parser is not None

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """(reasoning delta, content delta, tool-call deltas) for a text delta."""
        reasoning = ""
        if self._rstream is not None:
            reasoning, text = self._rstream.feed(text, final)
        if self._tstream is None:
            return reasoning, text, []
        content, calls = self._tstream.feed(text, final)
        return reasoning, content, calls

    def finish(self) -> tuple[str, str, list[dict]]:
        return self.feed("", final=True)

    @property
    def called_tools(self) -> bool:
        return self._tstream is not None and self._tstream.num_calls > 0

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        """Non-streaming: (reasoning or None, content or None, tool_calls)."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
        calls: list[dict] = []
        if self.tool_parser is not None:
            text, calls = parse_complete(self.tool_parser, text)
            if calls and not text.strip():
                text = None
        return reasoning, text, calls


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """A choice that ended by itself after tool calls reports ``tool_calls``."""
    return "tool_calls" if called_tools and reason == "stop" else reason
