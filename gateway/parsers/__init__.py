"""Tool-call and reasoning parsers, by the names vLLM's ``--tool-call-parser`` and ``--reasoning-parser`` use."""

from __future__ import annotations

from mlxd.gateway.parsers.base import ToolParser, ToolStream, parse_complete
from mlxd.gateway.parsers.gemma4 import Gemma4ToolParser
from mlxd.gateway.parsers.glm45 import Glm45ToolParser
from mlxd.gateway.parsers.harmony import HarmonyReasoningParser, HarmonyToolParser
from mlxd.gateway.parsers.hermes import HermesToolParser
from mlxd.gateway.parsers.llama3_json import Llama3JsonToolParser
from mlxd.gateway.parsers.mistral import Mistral3ToolParser, MistralToolParser
from mlxd.gateway.parsers.pythonic import PythonicToolParser
from mlxd.gateway.parsers.qwen3_coder import Qwen3CoderToolParser
from mlxd.gateway.parsers.reasoning import (Gemma4ReasoningParser, MistralReasoningParser, ReasoningParser, ReasoningStream,
                                       ThinkReasoningParser)
from mlxd.gateway.parsers.template_detect import AUTO, ParserChoice, choose_parsers
from mlxd.shared.errors import InvalidRequestError

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,  # Qwen 2.5 / 3 use the hermes format
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "mistral3": Mistral3ToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,
    "harmony": HarmonyToolParser,
    "openai": HarmonyToolParser,  # vLLM's name for gpt-oss's
    "gemma4": Gemma4ToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,  # GLM-4.7 writes the same without the newlines
}

# think, qwen3, deepseek_r1 and glm45 spell reasoning as <think>…</think>; whether
# the model starts inside the block is read from the prompt, not from the name.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "think": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
    "glm45": ThinkReasoningParser,
    "gemma4": Gemma4ReasoningParser,
    "mistral": MistralReasoningParser,
    "harmony": HarmonyReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,  # vLLM's name
}


def check_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Refuse a ``--tool-call-parser`` or ``--reasoning-parser`` these tables do not hold (the one list of names)."""
    for flag, name, table in (("tool_call_parser", tool_call_parser, TOOL_PARSERS),
                              ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
        if name is not None and name != AUTO and name not in table:
            raise InvalidRequestError(f"{flag} must be {AUTO} or one of {', '.join(table)} (got {name!r})",
                                      param=flag)


def keeps_special_tokens(tool_parser: ToolParser | None, reasoning_parser: str | None) -> bool:
    """Whether the parsers in use need the tokenizer's special tokens kept in the decoded text."""
    reasoning = REASONING_PARSERS[reasoning_parser].special_markers if reasoning_parser else ()
    return bool(reasoning or (tool_parser is not None and tool_parser.special_markers))


__all__ = ["AUTO", "REASONING_PARSERS", "TOOL_PARSERS", "ParserChoice", "check_names", "choose_parsers",
           "ReasoningStream", "ThinkReasoningParser", "ToolParser", "ToolStream", "parse_complete",
           "keeps_special_tokens"]
