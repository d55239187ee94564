"""Reasoning split from the answer, streaming and not: ``<think>…</think>``, Gemma 4's thought channel and
Mistral's ``[THINK]…[/THINK]``.

Models whose chat template opens the reasoning block in the prompt (Qwen3,
DeepSeek-R1) start generating inside it: ``starts_inside`` is decided from
the end of the rendered prompt. Like the tool parsers, a reasoning parser
reads incrementally (``scanning.Reader``) and never takes back what it gave.
"""

from __future__ import annotations

from typing import ClassVar

from mlxd.gateway.parsers.scanning import Markers, Reader


class ReasoningParser(Reader):
    """Reads one generation into reasoning and content; ``fresh()`` gives another for the next."""

    name: ClassVar[str]
    # Markers the tokenizer may hold as special tokens: kept in the decoded text while this parser is in use.
    special_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        self._reasoning: list[str] = []  # what the current feed settled
        self._content: list[str] = []

    def fresh(self) -> "ReasoningParser":
        raise NotImplementedError

    @classmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        """True when the rendered prompt leaves a reasoning block open (the model starts inside it)."""
        raise NotImplementedError

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) that the new text settled."""
        self.buf += text
        self._reasoning, self._content = [], []
        self.parse(final)
        return "".join(self._reasoning), "".join(self._content)

    def parse(self, final: bool) -> None:
        raise NotImplementedError

    def split(self, text: str) -> tuple[str | None, str]:
        """Non-streaming: (reasoning or None, content)."""
        reasoning, content = self.fresh().feed(text, True)
        return (reasoning or None), content


class ThinkReasoningParser(ReasoningParser):
    """``OPEN`` reasoning ``CLOSE`` answer; a reply that does not open with ``OPEN`` is all answer."""

    name = "think"
    OPEN: ClassVar[str] = "<think>"
    CLOSE: ClassVar[str] = "</think>"

    def __init__(self, starts_inside: bool = False):
        super().__init__()
        self.starts_inside = starts_inside
        self._state = "reasoning" if starts_inside else "start"  # start | reasoning | after | content
        self._close = Markers(self.CLOSE)

    def fresh(self) -> "ThinkReasoningParser":
        return type(self)(self.starts_inside)

    @classmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        return prompt.rstrip().endswith(cls.OPEN.rstrip())

    def parse(self, final: bool) -> None:
        while True:
            if self._state == "start":
                lead = self.buf.lstrip()
                self.meter.scanned += len(self.buf)
                if lead.startswith(self.OPEN):
                    self._take(len(self.buf) - len(lead) + len(self.OPEN))
                    self._state = "reasoning"
                elif not final and (not lead or self.OPEN.startswith(lead)):
                    return  # it may still open with OPEN (blanks or a partial marker)
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                # Cut off while reasoning: all of it is reasoning.
                if not self._stream_until(self._close, final, self._reasoning.append):
                    return
                self._state = "after"
            elif self._state == "after":
                rest = self.buf.lstrip("\n")
                self.meter.scanned += len(self.buf) - len(rest) + 1
                self._take(len(self.buf) - len(rest))
                if not rest and not final:
                    return
                self._state = "content"
            else:
                self.meter.scanned += len(self.buf)
                self._content.append(self._take(len(self.buf)))
                return


class Gemma4ReasoningParser(ThinkReasoningParser):
    """Gemma 4's thinking: ``<|channel>thought\\n…<channel|>`` before the answer."""

    name = "gemma4"
    OPEN = "<|channel>thought\n"
    CLOSE = "<channel|>"
    special_markers = ("<|channel>", "<channel|>")


class MistralReasoningParser(ThinkReasoningParser):
    """Magistral and the Mistral 3 reasoning models: ``[THINK]…[/THINK]`` (special tokens) before the answer."""

    name = "mistral"
    OPEN = "[THINK]"
    CLOSE = "[/THINK]"
    special_markers = (OPEN, CLOSE)


class ReasoningStream:
    """Streams (reasoning delta, content delta) pairs."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser.fresh()

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        return self.parser.feed(delta, final)

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)
