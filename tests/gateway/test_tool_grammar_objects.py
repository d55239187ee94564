"""Tool grammars hold arguments to the declared properties unless the schema opts into others."""

from __future__ import annotations

import json

import pytest

from mlxd.gateway.parsers import TOOL_PARSERS
from mlxd.gateway.parsers.base import closed_objects

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "where": {
    "type": "object", "properties": {"lat": {"type": "number"}}}}, "required": ["city"]}


def test_objects_that_declare_properties_are_closed_at_every_depth():
    closed = closed_objects({"type": "object", "properties": {
        "a": CITY, "b": {"type": "array", "items": CITY}, "c": {"anyOf": [CITY, {"type": "null"}]}},
        "$defs": {"d": CITY}})
    for sub in (closed, closed["properties"]["a"], closed["properties"]["a"]["properties"]["where"],
                closed["properties"]["b"]["items"], closed["properties"]["c"]["anyOf"][0], closed["$defs"]["d"]):
        assert sub["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["c"]["anyOf"][1]


def test_a_schema_that_says_otherwise_keeps_its_choice():
    open_ = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}
    typed = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}}
    assert closed_objects(open_) == open_ and closed_objects(typed) == typed
    free = {"type": "object"}  # declares nothing to default to
    assert closed_objects(free) == free
    split = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}  # one object over two parts
    assert closed_objects(split) == split
    assert CITY.get("additionalProperties") is None  # the caller's schema is not changed


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=49152)


def accepts(ll_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    from llguidance import LLMatcher

    m = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def call(args: dict) -> str:
    return '<tool_call>\n' + json.dumps({"name": "weather", "arguments": args}) + '\n</tool_call>'


def test_the_required_grammar_refuses_keys_the_tool_does_not_declare(ll_tokenizer, tokenizer):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]
    grammar = TOOL_PARSERS["hermes"](tools).grammar(tools, False, json.dumps)
    assert accepts(ll_tokenizer, tokenizer, grammar, call({"city": "Rome"}))
    assert accepts(ll_tokenizer, tokenizer, grammar, call({"city": "Rome", "where": {"lat": 41.9}}))
    assert not accepts(ll_tokenizer, tokenizer, grammar, call({"city": "Rome", "country": "IT"}))
    assert not accepts(ll_tokenizer, tokenizer, grammar, call({"city": "Rome", "where": {"lat": 1, "x": 2}}))
    opted = [{"type": "function", "function": {"name": "weather",
                                               "parameters": {**CITY, "additionalProperties": True}}}]
    grammar = TOOL_PARSERS["hermes"](opted).grammar(opted, False, json.dumps)
    assert accepts(ll_tokenizer, tokenizer, grammar, call({"city": "Rome", "country": "IT"}))
