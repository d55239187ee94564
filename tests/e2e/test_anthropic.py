"""Anthropic's Messages API through the official anthropic SDK, engine and gateway on loopback.

SmolLM2 cannot call tools of its own accord, so tool_choice any/tool (a grammar
in the hermes format) makes the calls; SmolLM2's template ignores tools and
renders tool turns as plain turns, which count_tokens shows.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.servers import Gateway

ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["a", "b"], "additionalProperties": False}}
ECHO = {"name": "echo", "description": "Repeat a word",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12}},
                         "required": ["word"], "additionalProperties": False}}
HI = [{"role": "user", "content": "Say hello."}]
# The SDK no longer names sampling parameters; older clients send them and the server takes them.
GREEDY = {"extra_body": {"temperature": 0.0}}
WARM = {"extra_body": {"temperature": 0.7}}


@pytest.fixture(scope="module")
def ac(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=120)


def test_text_message_has_blocks_usage_and_a_stop_reason(ac, model):
    m = ac.messages.create(model=model, max_tokens=12, system="You are terse.", messages=HI, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == model and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= m.usage.output_tokens <= 12
    count = ac.messages.count_tokens(model=model, system="You are terse.", messages=HI)
    # Anthropic reports cache reads beside input_tokens; together they are the whole prompt.
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_max_tokens_and_stop_sequences_set_the_stop_reason(ac, model):
    msgs = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    m = ac.messages.create(model=model, max_tokens=4, messages=msgs, **GREEDY)
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 4
    free = ac.messages.create(model=model, max_tokens=24, messages=msgs, **GREEDY)
    text = free.content[0].text
    # A stop sequence taken from the model's own greedy answer must end the same answer there.
    stop = text[len(text) // 3: len(text) // 3 + 2]
    assert stop.strip()
    m = ac.messages.create(model=model, max_tokens=24, messages=msgs, **GREEDY, stop_sequences=[stop, "zzz"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_streamed_message_equals_the_whole_one(ac, model):
    kw = dict(model=model, max_tokens=16, messages=HI, **GREEDY)
    whole = ac.messages.create(**kw)
    events = []
    with ac.messages.stream(**kw) as stream:
        for e in stream:
            events.append(e.type)
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events
    assert [b.type for b in final.content] == ["text"]
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_raw_event_sequence_is_anthropics(gateway, model):
    # Read the wire itself: the SDK drops ping events before a caller sees them.
    body = {"model": model, "max_tokens": 8, "messages": HI, "temperature": 0.0, "stream": True}
    names, datas = [], []
    with httpx.stream("POST", gateway.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                datas.append(json.loads(line[6:]))
    assert names == [d["type"] for d in datas]
    assert names[:2] == ["message_start", "ping"]
    rest = [n for n in names[2:] if n != "ping"]
    assert rest[0] == "content_block_start" and set(rest[1:-3]) == {"content_block_delta"}
    assert rest[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    usage = datas[names.index("message_delta")]["usage"]
    assert usage["output_tokens"] == 8 and usage["input_tokens"] + usage["cache_read_input_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(ac, model, stream):
    kw = dict(model=model, max_tokens=60, tools=[ADD, ECHO], **WARM,
              tool_choice={"type": "tool", "name": "add"},
              messages=[{"role": "user", "content": "What is 2 plus 3?"}])
    if stream:
        with ac.messages.stream(**kw) as s:
            deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
            m = s.get_final_message()
        assert "input_json_delta" in deltas
    else:
        m = ac.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "add" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, ADD["input_schema"])
    a, b = uses[0].input["a"], uses[0].input["b"]
    turn = kw["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": f"The sum is {a + b}, computed exactly by the add tool."}]}]
    follow = ac.messages.create(model=model, max_tokens=8, messages=turn, **GREEDY)
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens")
    # The tool result reaches the prompt: the turn costs what its text costs.
    empty = turn[:2] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id}]}]
    without = ac.messages.count_tokens(model=model, messages=empty)
    with_result = ac.messages.count_tokens(model=model, messages=turn)
    assert with_result.input_tokens >= without.input_tokens + 12
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens == with_result.input_tokens


def test_tool_choice_any_calls_one_of_the_tools(ac, model):
    # One call only: with parallel calls allowed, SmolLM2 often repeats the call past max_tokens.
    m = ac.messages.create(model=model, max_tokens=60, tools=[ADD, ECHO],
                           tool_choice={"type": "any", "disable_parallel_tool_use": True},
                           **WARM, messages=[{"role": "user", "content": "Echo the word banana."}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and m.stop_reason == "tool_use"
    for u in uses:
        jsonschema.validate(u.input, {"add": ADD, "echo": ECHO}[u.name]["input_schema"])
    none = ac.messages.create(model=model, max_tokens=6, tools=[ADD], tool_choice={"type": "none"}, messages=HI)
    assert all(b.type == "text" for b in none.content)


def test_system_blocks_and_block_turns_render(ac, model):
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
            {"role": "user", "content": "Bye"}]
    short = ac.messages.count_tokens(model=model, system=system[:1], messages=msgs)
    longer = ac.messages.count_tokens(model=model, system=system, messages=msgs)
    assert longer.input_tokens > short.input_tokens
    m = ac.messages.create(model=model, max_tokens=4, system=system, messages=msgs, metadata={"user_id": "u1"})
    assert m.content


def test_output_config_json_schema_validates(ac, model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    m = ac.messages.create(model=model, max_tokens=40, messages=[{"role": "user", "content": "Weather in Rome?"}],
                           output_config={"format": {"type": "json_schema", "schema": schema}}, **WARM)
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_errors_take_anthropics_shape(ac, gateway, model):
    r = httpx.post(gateway.url + "/v1/messages", json={"model": model, "messages": HI}, timeout=30)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        ac.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model=model, max_tokens=4, messages=HI, tools=[ADD],
                           tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model=model, max_tokens=8, messages=HI, tool_choice={"type": "any"},
                           tools=[{"name": "bad", "input_schema": {"type": "nonsense"}}])
    with pytest.raises(anthropic.NotFoundError) as err:
        ac.messages.create(model="no-such-model", max_tokens=4, messages=HI)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_api_key_in_x_api_key(engine, tmp_path, model):
    g = Gateway(engine.endpoint, str(tmp_path / "gateway-key.log"), extra=["--api-key", "sekret"]).start()
    try:
        g.wait_healthy()
        bad = anthropic.Anthropic(base_url=g.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as err:
            bad.messages.create(model=model, max_tokens=4, messages=HI)
        assert err.value.status_code == 401
        assert err.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": "invalid or missing API key"}}
        good = anthropic.Anthropic(base_url=g.url, api_key="sekret", max_retries=0)
        assert good.messages.create(model=model, max_tokens=2, messages=HI).usage.output_tokens >= 1
        assert good.messages.count_tokens(model=model, messages=HI).input_tokens > 0
    finally:
        g.stop()


def test_final_assistant_turn_is_a_prefill_the_answer_continues(ac, gateway, model):
    msgs = [{"role": "user", "content": "List three fruits."}, {"role": "assistant", "content": "1. Apple\n2."}]

    def tokenize(**kw) -> int:
        return httpx.post(gateway.url + "/tokenize", json={"messages": msgs, **kw}, timeout=30).json()["count"]

    continued = tokenize(add_generation_prompt=False, continue_final_message=True)
    assert continued != tokenize()
    assert ac.messages.count_tokens(model=model, messages=msgs).input_tokens == continued
    m = ac.messages.create(model=model, max_tokens=6, messages=msgs, **GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == continued
    assert m.content and not m.content[0].text.startswith("1. Apple")


@pytest.fixture(scope="module")
def thinking_ac(engine, tmp_path_factory):
    g = Gateway(engine.endpoint, str(tmp_path_factory.mktemp("logs") / "gateway-think.log"),
                extra=["--reasoning-parser", "qwen3"]).start()
    g.wait_healthy()
    yield anthropic.Anthropic(base_url=g.url, api_key="unused", max_retries=0, timeout=120)
    g.stop()


def test_reasoning_comes_back_as_thinking_blocks(thinking_ac, model):
    # A prefill that opens a think block starts the model inside it, as Qwen3's template would.
    msgs = [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "<think>"}]
    kw = dict(model=model, max_tokens=10, messages=msgs, **GREEDY)
    whole = thinking_ac.messages.create(**kw)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking
    with thinking_ac.messages.stream(**kw) as s:
        deltas = {e.delta.type for e in s if e.type == "content_block_delta"}
        final = s.get_final_message()
    assert "thinking_delta" in deltas
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]


def test_count_tokens_counts_a_conversation_longer_than_the_context(ac, model):
    # The e2e engine's context is 512 tokens: counting still answers, generating is a 400.
    msgs = [{"role": "user", "content": "word " * 700}]
    assert ac.messages.count_tokens(model=model, messages=msgs).input_tokens > 700
    n = ac.messages.count_tokens(model=model, messages=msgs).input_tokens
    # Anthropic's own wording and type, which its clients match to shorten the conversation.
    with pytest.raises(anthropic.BadRequestError) as err:
        ac.messages.create(model=model, max_tokens=4, messages=msgs)
    assert err.value.body["error"] == {"type": "invalid_request_error",
                                       "message": f"prompt is too long: {n} tokens > 511 maximum"}


def test_max_tokens_past_the_context_is_clamped(ac, model):
    # Claude Code asks for 32000 whatever the model's context (512 here).
    m = ac.messages.create(model=model, max_tokens=32000, messages=HI, stop_sequences=["."], **GREEDY)
    assert m.content and m.usage.output_tokens <= 512


def test_system_turns_inside_messages_join_the_system_prompt(ac, model):
    system = "You are terse."
    inner = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Answer in English."},
             {"role": "user", "content": "Bye"}]
    folded = ac.messages.count_tokens(model=model, messages=inner, system=system).input_tokens
    plain = ac.messages.count_tokens(model=model, messages=[inner[0], inner[2]],
                                     system=system + "\n\nAnswer in English.").input_tokens
    assert folded == plain
    m = ac.messages.create(model=model, max_tokens=4, system=system, messages=inner)
    assert m.content


def test_stream_start_usage_agrees_with_the_end_on_cached_tokens(gateway, model):
    body = {"model": model, "max_tokens": 4, "stream": True, "temperature": 0.0,
            "system": "You are a helpful assistant who answers every question briefly and politely.",
            "messages": [{"role": "user", "content": "Name a colour that the sky can have at dusk."}]}
    for _ in range(2):  # the second finds the prompt in the prefix cache
        r = httpx.post(gateway.url + "/v1/messages", json=body, timeout=60)
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        start = events[0]["message"]["usage"]
        end = next(e for e in events if e["type"] == "message_delta")["usage"]
        for k in ("input_tokens", "cache_read_input_tokens"):
            assert start[k] == end[k], (start, end)
    assert end["cache_read_input_tokens"] > 0


def test_a_tool_call_cut_by_max_tokens_is_not_a_finished_tool_use(ac, model):
    m = ac.messages.create(model=model, max_tokens=8, tools=[ADD], tool_choice={"type": "any"},
                           messages=[{"role": "user", "content": "Add 4 and 5."}])
    assert m.stop_reason == "max_tokens"
    assert [b for b in m.content if b.type == "tool_use"] == []
