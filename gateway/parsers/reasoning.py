"""``<think>…</think>`` reasoning, split from the answer, streaming and not.

Models whose chat template opens the think block in the prompt (Qwen3,
DeepSeek-R1) start generating inside it: ``starts_inside`` is decided from
the end of the rendered prompt. Like the tool parsers, ``scan`` never takes
back what it gave for a shorter text, so streaming is the difference of scans.
"""

from __future__ import annotations

from gateway.parsers.base import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


class ThinkReasoningParser:
    name = "think"

    def __init__(self, starts_inside: bool = False):
        self.starts_inside = starts_inside

    @staticmethod
    def prompt_opens_reasoning(prompt: str) -> bool:
        """True when the rendered prompt leaves a think block open (the model starts inside it)."""
        tail = prompt.rstrip()
        return tail.endswith(OPEN)

    def scan(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        if self.starts_inside:
            body = text
        else:
            lead = text.lstrip()
            if not lead.startswith(OPEN):
                # A reply that does not open with <think> has no reasoning; wait
                # while it still might (blanks or a partial tag).
                if not final and (not lead or OPEN.startswith(lead)):
                    return "", ""
                return "", text
            body = lead[len(OPEN):]
        end = body.find(CLOSE)
        if end < 0:
            # Still thinking (or cut off while thinking: all of it is reasoning).
            return (body if final else body[: len(body) - partial_suffix(body, CLOSE)]), ""
        return body[:end], body[end + len(CLOSE):].lstrip("\n")

    def split(self, text: str) -> tuple[str | None, str]:
        """Non-streaming: (reasoning or None, content)."""
        reasoning, content = self.scan(text, True)
        return (reasoning or None), content


class ReasoningStream:
    """Streams (reasoning delta, content delta) pairs."""

    def __init__(self, parser: ThinkReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent = (0, 0)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.scan(self.text, final)
        r0, c0 = self.sent
        self.sent = (max(r0, len(reasoning)), max(c0, len(content)))
        return reasoning[r0:], content[c0:]

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)
