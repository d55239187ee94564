"""Request fields to grammar specs: what each becomes, and the 400s for what cannot work."""

import json

import pytest

from mlxd.gateway.chat_run import ChatOutput, finish_reason
from mlxd.gateway.parsers import TOOL_PARSERS
from mlxd.gateway.schema_finite import has_finite_value
from mlxd.gateway.structured import (marker_literal, one_spec, response_format_spec, structured_outputs_spec,
                                tool_plan)
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import StructuredSpec

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "noop"}}]


def plan(choice, parser=None, auto=False, parallel=None, tools=TOOLS):
    return tool_plan(tools, choice, parallel, parser, auto, json.dumps)


def test_response_format_kinds():
    assert response_format_spec({"type": "text"}) is None
    assert response_format_spec({"type": "json_object"}) == StructuredSpec("json_object")
    s = response_format_spec({"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                    "schema": {"type": "object"}}})
    assert s.kind == "json_schema" and json.loads(s.spec) == {"type": "object"}
    for bad in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}}, {"type": "xml"}):
        with pytest.raises(InvalidRequestError):
            response_format_spec(bad)


def test_structured_outputs_forms():
    assert structured_outputs_spec({"regex": "a+"}) == StructuredSpec("regex", "a+")
    assert structured_outputs_spec({"choice": ["x", "y"]}) == StructuredSpec("choice", '["x", "y"]')
    assert structured_outputs_spec({"json": {"type": "integer"}}).kind == "json_schema"
    assert structured_outputs_spec({"grammar": 'start: "a"'}).kind == "grammar"
    for bad in ({"regex": "a", "choice": ["a"]}, {"choice": []}, {"regex": 5}, {"nothing": 1}):
        with pytest.raises(InvalidRequestError):
            structured_outputs_spec(bad)


def test_two_constraints_at_once_are_refused():
    with pytest.raises(InvalidRequestError, match="cannot both"):
        one_spec(("response_format", StructuredSpec("json_object")), ("structured_outputs", StructuredSpec("regex")))
    assert one_spec(("a", None), ("b", StructuredSpec("regex", "x"))).kind == "regex"


def test_tool_choice_plans():
    assert plan("none").parser is None and plan(None).parser is None  # no auto without the flag
    assert plan(None, "hermes", auto=True).spec is None  # auto: parse, don't constrain
    req = plan("required")
    assert req.spec.kind == "grammar" and req.parser.name == "hermes"  # default format
    named = plan({"type": "function", "function": {"name": "add"}}, "llama3_json")
    assert named.parser.name == "llama3_json" and '"add"' in named.spec.spec and '"noop"' not in named.spec.spec
    with pytest.raises(InvalidRequestError, match="enable-auto-tool-choice"):
        plan("auto")
    with pytest.raises(InvalidRequestError, match="not among"):
        plan({"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidRequestError):
        plan("sometimes")
    with pytest.raises(InvalidRequestError, match="needs tools"):
        plan("required", tools=None)
    with pytest.raises(InvalidRequestError):
        plan("required", tools=[{"type": "function", "function": {"parameters": {}}}])


def test_special_markers_become_token_references(tokenizer):
    literal = marker_literal(tokenizer)
    assert literal("<|im_end|>").startswith("<[")
    assert literal("<tool_call>") == '"<tool_call>"'


def test_chat_output_streams_what_it_returns_whole():
    text = "<think>plan</think>\nSure.<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>"
    whole = ChatOutput("qwen3", "prompt", TOOL_PARSERS["hermes"](TOOLS)).whole(text)
    assert whole[0] == "plan" and whole[1] == "Sure." and whole[2][0]["function"]["name"] == "add"
    out = ChatOutput("qwen3", "prompt", TOOL_PARSERS["hermes"](TOOLS))
    r, c, calls = "", "", []
    for ch in text:
        dr, dc, dt = out.feed(ch)
        r, c, calls = r + dr, c + dc, calls + dt
    dr, dc, dt = out.finish()
    r, c, calls = r + dr, c + dc, calls + dt
    assert (r, c) == ("plan", "Sure.")
    assert json.loads("".join(d["function"]["arguments"] for d in calls)) == {"a": 1, "b": 2}
    assert finish_reason("stop", out.called_tools) == "tool_calls"
    assert finish_reason("length", out.called_tools) == "length"


def test_history_tool_call_arguments_reach_templates_as_objects():
    from mlxd.gateway.openai_types import ChatMessage
    from mlxd.gateway.params import message_dicts

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = message_dicts([ChatMessage(role="user", content="hi"),
                          ChatMessage(role="assistant", content=None, tool_calls=[call]),
                          ChatMessage(role="tool", content="3", tool_call_id="call_1")])
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert call["function"]["arguments"] == '{"a": 1, "b": 2}'  # the request itself is left as it was
    bad = {**call, "function": {"name": "add", "arguments": "{not json"}}
    with pytest.raises(InvalidRequestError) as err:
        message_dicts([ChatMessage(role="assistant", tool_calls=[bad])])
    assert err.value.param == "messages[0].tool_calls[0].function.arguments"


SELF = {"$ref": "#"}
ENDLESS = [
    {"type": "object", "properties": {"a": SELF}, "required": ["a"]},
    {"type": "array", "items": SELF, "minItems": 1},
    {"anyOf": [{"type": "object", "properties": {"a": SELF}, "required": ["a"]},
               {"type": "array", "prefixItems": [SELF], "minItems": 1}]},
    {"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
               "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}},
     "$ref": "#/$defs/A"},
    {"type": "object", "properties": {"a": {"allOf": [SELF, {"type": "object"}]}}, "required": ["a"]},
]
FINITE = [
    {"type": "object", "properties": {"a": SELF}},  # the recursion may stop: "a" is optional
    {"type": "array", "items": SELF},
    {"anyOf": [{"type": "object", "properties": {"a": SELF}, "required": ["a"]}, {"type": "null"}]},
    {"$defs": {"T": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}},
                     "required": ["kids"]}}, "$ref": "#/$defs/T"},
    {"properties": {"a": SELF}, "required": ["a"]},  # no type: a number is a value of it
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]},
]


@pytest.mark.parametrize("schema", ENDLESS, ids=range(len(ENDLESS)))
def test_schemas_that_require_themselves_are_refused_with_the_reason(schema):
    with pytest.raises(InvalidRequestError, match="no finite JSON value") as err:
        response_format_spec({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert err.value.param == "response_format.json_schema.schema"
    for value in (schema, json.dumps(schema)):
        with pytest.raises(InvalidRequestError, match="no finite JSON value"):
            structured_outputs_spec({"json": value})
    tools = [TOOLS[1], {"type": "function", "function": {"name": "loop", "parameters": schema}}]
    with pytest.raises(InvalidRequestError, match="'loop' admits no finite") as err:
        plan("required", tools=tools)
    assert err.value.param == "tools[1].function.parameters"
    # Only a grammar is held to a tool's parameters: auto tool choice and another named tool are not refused.
    assert plan({"type": "function", "function": {"name": "noop"}}, tools=tools).spec is not None
    assert plan(None, "hermes", auto=True, tools=tools).spec is None


@pytest.mark.parametrize("schema", FINITE, ids=range(len(FINITE)))
def test_recursive_schemas_with_a_way_out_are_accepted(schema):
    assert response_format_spec({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert structured_outputs_spec({"json": schema})


def test_a_deep_schema_is_checked_without_recursion():
    deep = inner = {}
    for _ in range(100_000):
        inner["anyOf"] = [{"type": "object", "properties": {"a": SELF}, "required": ["a"]}, {}]
        inner = inner["anyOf"][1]
    assert has_finite_value(deep)
    inner["type"] = "object"
    inner["properties"], inner["required"] = {"a": SELF}, ["a"]
    assert not has_finite_value(deep)


@pytest.mark.parametrize("given,sent", [
    (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
    (r"\D+", "[^0-9]+"),
    (r"[\dA-F]+", "[0-9A-F]+"),
    (r"[^\D]", "[^[^0-9]]"),
    (r"[]\d]", "[]0-9]"),
    (r"\\d\\\d", r"\\d\\[0-9]"),  # an escaped backslash, then a d; then one before \d
    (r"\p{Nd}\w\.", r"\p{Nd}\w\."),  # other escapes are the client's own
])
def test_regex_digits_mean_ascii_digits(given, sent):
    assert structured_outputs_spec({"regex": given}) == StructuredSpec("regex", sent)
