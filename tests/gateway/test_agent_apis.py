"""Anthropic Messages and OpenAI Responses bodies translated into chat terms, and their error shapes."""

from __future__ import annotations

import json

import msgspec
import pytest

from mlxd.gateway import anthropic as A
from mlxd.gateway import responses as R
from mlxd.gateway.errors import anthropic_error_body, error_body
from mlxd.gateway.responses_tools import responses_tools
from mlxd.shared.errors import AuthenticationError, EngineUnavailableError, InvalidRequestError, OverloadedError

# Renders tools and calls the way Qwen-style templates do: arguments through tojson.
TOOL_TEMPLATE = (
    "{% if tools %}[tools {{ tools | tojson }}]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments | tojson }})"
    "{% endfor %}{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}")


def anthropic_request(**body) -> A.MessagesRequest:
    return msgspec.json.decode(json.dumps({"max_tokens": 8, **body}), type=A.MessagesRequest)


def test_anthropic_turns_become_chat_messages():
    req = anthropic_request(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Use tools."}],
        messages=[
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should add.", "signature": "x"},
                {"type": "text", "text": "Calling add."},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "5"}]},
                {"type": "text", "text": "Thanks."}]}],
        tools=[{"name": "add", "description": "Add", "input_schema": {"type": "object"}}],
        tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_k=20)
    inp = A.chat_input(req)
    assert inp.messages == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "Calling add.", "reasoning_content": "I should add.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        {"role": "user", "content": "Thanks."}]
    assert inp.tools == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"},
                                                          "description": "Add"}}]
    assert inp.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert inp.parallel_tool_calls is False
    assert (inp.stop, inp.temperature, inp.top_k, inp.max_tokens, inp.continue_final) == (["END"], 0.5, 20, 8, False)


def test_anthropic_tool_choice_kinds():
    assert A._tool_choice({"type": "any"}) == ("required", None)
    assert A._tool_choice({"type": "auto"}) == ("auto", None)
    assert A._tool_choice({"type": "none"}) == ("none", None)
    assert A._tool_choice(None) == (None, None)
    with pytest.raises(InvalidRequestError):
        A._tool_choice({"type": "tool"})


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "y", "input": {}}]}]},
    {"messages": [{"role": "tool", "content": "no"}]},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "no_schema"}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "xml"}}},
])
def test_anthropic_bodies_that_are_400s(body):
    with pytest.raises(InvalidRequestError):
        A.chat_input(anthropic_request(**body))


def test_calls_reach_the_template_as_objects(tokenizer):
    req = anthropic_request(messages=[
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}]}],
        tools=[{"name": "add", "input_schema": {"type": "object"}}])
    inp = A.chat_input(req)
    text = tokenizer.render_chat(inp.messages, tools=inp.tools, chat_template=TOOL_TEMPLATE,
                                 add_generation_prompt=False)
    # Not double-encoded: the template's tojson sees an object, not a string of JSON.
    assert '(call add {"a": 1})' in text and "<tool>1(for t1)" in text and '"name": "add"' in text
    resp = msgspec.json.decode(json.dumps({"input": [
        {"role": "user", "content": "Add."},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}]}), type=R.ResponsesRequest)
    rinp = r_input(resp)
    assert tokenizer.render_chat(rinp.messages, chat_template=TOOL_TEMPLATE, add_generation_prompt=False) == \
        tokenizer.render_chat(inp.messages, chat_template=TOOL_TEMPLATE, add_generation_prompt=False).replace(
            "t1", "c1")


def r_input(req: R.ResponsesRequest):
    return R.chat_input(req, responses_tools(req.tools))


def responses_request(**body) -> R.ResponsesRequest:
    return msgspec.json.decode(json.dumps(body), type=R.ResponsesRequest)


def test_responses_items_become_chat_messages():
    req = responses_request(
        instructions="Be brief.", max_output_tokens=9,
        input=[{"type": "message", "role": "developer", "content": "Prefer tools."},
               {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
               {"type": "reasoning", "id": "rs_1", "summary": []},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
               {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Rome"}'},
               {"type": "function_call", "call_id": "c2", "name": "w", "arguments": ""},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
        tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}, "strict": True}],
        tool_choice={"type": "function", "name": "w"},
        text={"format": {"type": "json_schema", "name": "f", "schema": {"type": "object"}}})
    inp = r_input(req)
    assert inp.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Prefer tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Rome"}}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert inp.tools == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    assert inp.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert inp.response_format == {"type": "json_schema", "json_schema": {"name": "f", "schema": {"type": "object"}}}
    assert inp.max_tokens == 9 and inp.param == "input"
    assert r_input(responses_request(input="hi")).messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError) as err:
        r_input(responses_request(input=[
            {"type": "function_call", "call_id": "c", "name": "w", "arguments": "not json"}]))
    assert err.value.param == "input[0].arguments"


def test_error_shapes_side_by_side():
    cases = [(InvalidRequestError("bad", param="x"), 400, "invalid_request_error"),
             (AuthenticationError("key"), 401, "authentication_error"),
             (OverloadedError("busy"), 429, "rate_limit_error"),
             (EngineUnavailableError("gone"), 503, "overloaded_error"),
             (RuntimeError("bug"), 500, "api_error")]
    for exc, status, kind in cases:
        s, body = anthropic_error_body(exc)
        assert s == status and body["type"] == "error" and body["error"]["type"] == kind
        assert set(body["error"]) == {"type", "message"}
        s2, openai_body = error_body(exc)
        assert s2 == status and set(openai_body["error"]) == {"message", "type", "param", "code"}


def test_responses_tools_flatten_namespaces_and_qualify_only_clashing_names():
    fn = {"type": "function", "name": "read", "parameters": {"type": "object"}}
    t = responses_tools([fn, {"type": "namespace", "name": "fs", "description": "Files", "tools": [
        {"type": "function", "name": "read"}, {"type": "function", "name": "write"}]},
        {"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}])
    assert [c["function"]["name"] for c in t.chat] == ["read", "fs__read", "write"]
    assert t.client_name("fs__read") == ("read", "fs") and t.client_name("write") == ("write", "fs")
    assert t.client_name("read") == ("read", None) and t.flat_name("read", "fs") == "fs__read"
    for bad, param in (([{"type": "custom", "name": "x"}], "tools[0]"),
                       ([{"type": "namespace", "name": "n"}], "tools[0]"),
                       ([{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}], "tools[0].tools[0]"),
                       ([{"type": "function"}], "tools[0].name"),
                       ([fn, fn], "tools")):
        with pytest.raises(InvalidRequestError) as err:
            responses_tools(bad)
        assert err.value.param == param


@pytest.mark.parametrize("kind", [[65, 66], {"a": 1}, 7, None])
def test_a_responses_tool_whose_type_is_not_a_string_is_a_400(kind):
    # A list or dict as the type was an unhashable set lookup: a 500 (bench.fuzz, seed 2).
    with pytest.raises(InvalidRequestError, match="only function and namespace tools") as err:
        responses_tools([{"type": kind, "name": "add", "parameters": {"type": "object"}}])
    assert err.value.param == "tools[0]"
