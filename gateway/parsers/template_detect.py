"""Which parsers a chat template implies: read from the markers the template writes.

Only formats the template spells unambiguously are named (the checks run
from the most specific markers to the least); any other template names none.
``--tool-call-parser auto`` and ``--reasoning-parser auto`` use what this
finds. Unset, the flags keep vLLM's meaning (no parsing) with two exceptions:
the format that required and named tool choice are held to follows the
template, and harmony's channels are always read, since every gpt-oss reply
is framed in them (vLLM reads them for gpt-oss without a flag too).
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
# Without a parser named or found, required and named tool choice use this format.
DEFAULT_TOOL_FORMAT = "hermes"


def template_parsers(template: str | None) -> tuple[str | None, str | None]:
    """(tool-call parser, reasoning parser) that ``template`` implies, None where it implies none."""
    if not isinstance(template, str):
        return None, None
    think = "think" if "<think>" in template else None
    if "<|channel|>" in template and "<|message|>" in template:
        return "harmony", "harmony"
    if "<|tool_call>" in template and "<tool_call|>" in template:
        return "gemma4", "gemma4" if "<|channel>" in template else None
    if "<arg_key>" in template and "<arg_value>" in template:
        return "glm45", think
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder", think
    if "[TOOL_CALLS]" in template:
        return ("mistral3" if "[ARGS]" in template else "mistral"), "mistral" if "[THINK]" in template else None
    if "<tool_call>" in template:
        return "hermes", think
    if "<|python_tag|>" in template:
        return "llama3_json", think
    return None, think


@dataclass(frozen=True)
class ParserChoice:
    """The parsers one model is served with."""

    tool: str | None  # reads calls for tool_choice "auto"; None: not enabled
    tool_format: str  # the format required and named tool choice are held to
    reasoning: str | None


def choose_parsers(tool_call_parser: str | None, reasoning_parser: str | None,
                   template: str | None) -> ParserChoice:
    """The flags' parsers, with ``auto`` (and the unset tool-choice format) taken from ``template``."""
    found_tool, found_reasoning = template_parsers(template)
    tool = (found_tool or DEFAULT_TOOL_FORMAT) if tool_call_parser == AUTO else tool_call_parser
    reasoning = found_reasoning if reasoning_parser == AUTO else reasoning_parser
    if reasoning_parser is None and found_reasoning == "harmony":
        reasoning = "harmony"
    return ParserChoice(tool, tool or found_tool or DEFAULT_TOOL_FORMAT, reasoning)
