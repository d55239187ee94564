"""Tool-call and reasoning parsers, by the names vLLM's ``--tool-call-parser`` and ``--reasoning-parser`` use."""

from __future__ import annotations

from gateway.parsers.base import ToolParser, ToolStream, parse_complete
from gateway.parsers.hermes import HermesToolParser
from gateway.parsers.llama3_json import Llama3JsonToolParser
from gateway.parsers.mistral import MistralToolParser
from gateway.parsers.pythonic import PythonicToolParser
from gateway.parsers.qwen3_coder import Qwen3CoderToolParser
from gateway.parsers.reasoning import ReasoningStream, ThinkReasoningParser
from shared.errors import InvalidRequestError

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



def check_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Refuse a ``--tool-call-parser`` or ``--reasoning-parser`` these tables do not hold (the one list of names)."""
    for flag, name, table in (("tool_call_parser", tool_call_parser, TOOL_PARSERS),
                              ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
        if name is not None and name not in table:
            raise InvalidRequestError(f"{flag} must be one of {', '.join(table)} (got {name!r})", param=flag)


__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "check_names", "ReasoningStream", "ThinkReasoningParser", "ToolParser",
           "ToolStream", "parse_complete"]
