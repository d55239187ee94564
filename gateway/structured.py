"""Request fields that constrain the output, turned into the grammar spec the engine compiles.

``response_format`` (OpenAI), ``structured_outputs`` (vLLM) and ``tool_choice``
``required`` or named (a grammar in the model's own tool-call format) each
become one ``StructuredSpec``; asking for two at once is a 400. A JSON schema
that admits no finite value is a 400 here (``schema_finite``), and ``\\d`` in
a regex means [0-9] (``regex_digits``). The engine compiles the spec and
answers a bad schema or grammar with a 400 of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxd.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS, ToolParser
from mlxd.gateway.parsers.template_detect import DEFAULT_TOOL_FORMAT
from mlxd.gateway.regex_digits import ascii_digits
from mlxd.gateway.schema_finite import check_finite
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import StructuredSpec


@dataclass
class ToolPlan:
    """How one chat request treats tools: the parser reading calls (None: plain content) and the spec."""

    parser: ToolParser | None
    spec: StructuredSpec | None


# A request without tools: no parser, no constraint.
NO_TOOLS = ToolPlan(None, None)


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI function tools, checked; InvalidRequestError naming the bad one."""
    out = []
    for i, tool in enumerate(tools or []):
        f = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(f, dict):
            raise InvalidRequestError("each tool must be {\"type\": \"function\", \"function\": {...}}",
                                      param=f"tools[{i}]")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise InvalidRequestError("a function tool needs a name", param=f"tools[{i}].function.name")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError("function parameters must be a JSON schema object",
                                      param=f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": f})
    return out


def tool_plan(tools: list[dict[str, Any]] | None, tool_choice: str | dict | None, parallel: bool | None,
              parser_name: str | None, auto_enabled: bool, literal,
              tool_format: str = DEFAULT_TOOL_FORMAT) -> ToolPlan:
    """Decide parsing and constraint for ``tools`` + ``tool_choice``.

    ``parser_name`` reads "auto" tool choice's calls; required and named tool
    choice are held to ``tool_format`` (the same format when a parser is named).
    ``literal(marker)`` is the grammar's term for a format marker (a special
    token reference when the tokenizer holds it as one).
    """
    tools = check_tools(tools)
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return NO_TOOLS
    parallel = True if parallel is None else parallel
    if tool_choice is None:
        # OpenAI's default with tools is "auto"; without a parser to read calls
        # it degrades to "none" rather than refusing every request with tools.
        tool_choice = "auto" if auto_enabled else "none"
    if tool_choice == "none":
        return NO_TOOLS
    if tool_choice == "auto":
        if not auto_enabled:
            raise InvalidRequestError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                "--tool-call-parser", param="tool_choice")
        return ToolPlan(TOOL_PARSERS[parser_name](tools), None)
    if tool_choice == "required":
        chosen = tools
    elif isinstance(tool_choice, dict):
        f = tool_choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}', param="tool_choice")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools",
                                      param="tool_choice")
        parallel = False
    else:
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or a named function',
                                  param="tool_choice")
    picked = {id(t) for t in chosen}
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        if params is not None and id(tool) in picked:
            check_finite(params, f"tools[{i}].function.parameters", f"the parameters of {tool['function']['name']!r}")
    parser = TOOL_PARSERS[parser_name or tool_format](tools)
    return ToolPlan(parser, StructuredSpec("grammar", parser.grammar(chosen, parallel, literal)))


def response_format_spec(response_format: dict[str, Any] | None) -> StructuredSpec | None:
    """OpenAI ``response_format``: text, json_object, or json_schema (strict or not: the schema is enforced)."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "json_schema":
        js = response_format.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("response_format json_schema needs json_schema.schema, a JSON schema object",
                                      param="response_format.json_schema")
        check_finite(schema, "response_format.json_schema.schema", "response_format's json_schema")
        return StructuredSpec("json_schema", json.dumps(schema))
    raise InvalidRequestError(f"response_format type must be text, json_object or json_schema, not {kind!r}",
                              param="response_format.type")


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_spec(so: dict[str, Any] | None) -> StructuredSpec | None:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""
    if not so:
        return None
    given = [k for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KEYS)}",
                                  param="structured_outputs")
    key = given[0]
    value = so[key]
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise InvalidRequestError("structured_outputs.json is not valid JSON",
                                          param="structured_outputs.json") from None
        if isinstance(value, (dict, bool)):
            check_finite(value, "structured_outputs.json", "structured_outputs.json")
            return StructuredSpec("json_schema", json.dumps(value))
    elif key == "regex":
        if isinstance(value, str) and value:
            return StructuredSpec("regex", ascii_digits(value))
    elif key == "json_object":
        return StructuredSpec("json_object")
    elif key == "choice":
        if isinstance(value, list) and value and all(isinstance(c, str) for c in value):
            return StructuredSpec("choice", json.dumps(value))
    elif isinstance(value, str) and value:
        return StructuredSpec(key, value)
    raise InvalidRequestError(f"structured_outputs.{key} has the wrong type", param=f"structured_outputs.{key}")


def one_spec(*specs: tuple[str, StructuredSpec | None]) -> StructuredSpec | None:
    """The one constraint of a request; two at once is a 400 naming both."""
    given = [(name, s) for name, s in specs if s is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"{given[0][0]} and {given[1][0]} cannot both constrain the output",
                                  param=given[1][0])
    return given[0][1] if given else None


def marker_literal(tokenizer):
    """``literal`` for grammars: a special token as ``<[id]>``, anything else as a quoted string."""
    hf = tokenizer.hf
    special = set(getattr(hf, "all_special_tokens", []) or [])
    for tok in (getattr(hf, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            special.add(str(tok))

    def literal(marker: str) -> str:
        if marker in special:
            tid = hf.convert_tokens_to_ids(marker)
            if isinstance(tid, int) and tid >= 0:
                return f"<[{tid}]>"
        return json.dumps(marker)

    return literal


def reasoning_aware(spec: StructuredSpec | None, reasoning_parser: str | None, prompt_text: str,
                    literal) -> StructuredSpec | None:
    """``spec`` held to the answer only, when the prompt leaves a think block open.

    A model whose template opens ``<think>`` reasons first; a grammar from the
    first token would force the JSON (or the tool call) into the reasoning and
    leave the answer empty. The reasoning is free text up to ``</think>``, then
    the constraint applies (vLLM's reasoning-aware structured outputs), for
    response_format, structured_outputs and tool choice alike.
    """
    if spec is None or not reasoning_parser:
        return spec
    if not REASONING_PARSERS[reasoning_parser].prompt_opens_reasoning(prompt_text):
        return spec
    close = REASONING_PARSERS[reasoning_parser].CLOSE
    head = (f"start: reasoning answer\nreasoning[lazy]: /(?s:.*)/ {literal(close)}\n"
            "answer: /\\n*/ constrained\n")
    return StructuredSpec("grammar", head + _as_rule(spec))


def _as_rule(spec: StructuredSpec) -> str:
    """Lark rules defining ``constrained`` as what ``spec`` admits."""
    if spec.kind == "json_schema":
        return f"constrained: %json {spec.spec}\n"
    if spec.kind == "json_object":
        return 'constrained: %json {"type": "object"}\n'
    if spec.kind == "choice":
        return "constrained: " + " | ".join(json.dumps(c) for c in json.loads(spec.spec)) + "\n"
    if spec.kind == "regex":
        return "constrained: /" + spec.spec.replace("/", "\\/") + "/\n"
    # A Lark grammar: its start rule becomes the answer's (our tool grammars define it once, first).
    lines = spec.spec.splitlines()
    renamed = ["constrained:" + line[len("start:"):] if line.startswith("start:") else line for line in lines]
    if renamed == lines:
        raise InvalidRequestError("a grammar needs a start rule", param="structured_outputs.grammar")
    return "\n".join(renamed) + "\n"
