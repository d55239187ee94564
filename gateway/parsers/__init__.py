"""Tool-call and reasoning parsers, by the names vLLM's ``--tool-call-parser`` and ``--reasoning-parser`` use."""

from __future__ import annotations

from gateway.parsers.base import ToolParser, ToolStream, parse_complete
from gateway.parsers.hermes import HermesToolParser
from gateway.parsers.llama3_json import Llama3JsonToolParser
from gateway.parsers.mistral import MistralToolParser
from gateway.parsers.pythonic import PythonicToolParser
from gateway.parsers.qwen3_coder import Qwen3CoderToolParser
from gateway.parsers.reasoning import ReasoningStream, ThinkReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,  # Qwen 2.5 / 3 use the hermes format
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,
}

# Every one of these spells reasoning as <think>…</think>; whether the model
# starts inside the block is read from the prompt, not from the name.
REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "think": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
}

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "ReasoningStream", "ThinkReasoningParser", "ToolParser",
           "ToolStream", "parse_complete"]
