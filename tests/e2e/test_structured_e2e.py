"""Structured output, tool calls and reasoning through the real openai SDK, engine and gateway on loopback.

SmolLM2 samples at temperature > 0 and the grammar alone keeps it in line:
every json_schema answer validates, regex and choice answers match, and
tool_choice required/named always yields calls whose arguments validate.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.servers import Gateway

TEMP = 0.7


@pytest.fixture(scope="module")
def tools_gateway(engine, tmp_path_factory):
    g = Gateway(engine.endpoint, str(tmp_path_factory.mktemp("logs") / "gateway-tools.log"),
                extra=["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                       "--trust-request-chat-template"])  # test_tools_reach_the_chat_template sends one
    g.start()
    g.wait_healthy()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def tc(tools_gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=180)


def s(maxlen=16):
    return {"type": "string", "maxLength": maxlen}


SCHEMAS = [
    {"type": "object", "properties": {"name": s(), "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": s(8), "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"city": s(), "country": {"enum": ["FR", "DE", "IT", "ES"]},
                                      "population": {"type": "integer", "minimum": 1, "maximum": 99999999}},
     "required": ["city", "country", "population"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "roles": {"type": "array", "items": {
            "enum": ["admin", "dev", "ops"]}, "maxItems": 2}}, "required": ["id", "roles"],
        "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
        "type": "integer", "minimum": 0, "maximum": 100}}, "required": ["answer", "confidence"],
     "additionalProperties": False},
    {"type": "object", "properties": {"title": s(20), "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "sf"]},
                                                 "minItems": 1, "maxItems": 2}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": s(6), "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
]
PROMPTS = ["Describe a person.", "Pick a colour.", "Tag this post about cooking.", "Give a point on a grid.",
           "Name a European city.", "List a few small numbers.", "Describe a user account.",
           "Is the sky blue?", "Recommend a film.", "Write a small order."]


def test_twenty_json_schema_requests_validate_at_temperature(client, model):
    cases = [(SCHEMAS[i % 10], PROMPTS[i % 10], i) for i in range(20)]

    def one(case):
        schema, prompt, i = case
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
            temperature=TEMP, seed=i, max_tokens=160,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return schema, r.choices[0]

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, cases))
    for schema, choice in results:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_streamed_json_schema(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A JSON object, please."}],
                                       temperature=TEMP, seed=5, max_tokens=60,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[4]}], temperature=TEMP, seed=3, max_tokens=120,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[4]}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[4])


def test_regex_and_choice_are_honoured(client, model):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,2}"

    def regex(seed):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A month and a day."}], temperature=TEMP,
            seed=seed, max_tokens=20, extra_body={"structured_outputs": {"regex": pattern}}).choices[0]

    def choice(seed):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Cat or dog?"}], temperature=TEMP, seed=seed,
            max_tokens=10, extra_body={"structured_outputs": {"choice": ["cat", "dog", "neither"]}}).choices[0]

    with ThreadPoolExecutor(8) as pool:
        regexes = [pool.submit(regex, s) for s in range(4)]
        choices = [pool.submit(choice, s) for s in range(4)]
        for f in regexes:
            assert re.fullmatch(pattern, f.result().message.content), f.result().message.content
        for f in choices:
            assert f.result().message.content in ("cat", "dog", "neither")
            assert f.result().finish_reason == "stop"
    r = client.completions.create(model=model, prompt="The year was", max_tokens=8, temperature=TEMP,
                                  extra_body={"structured_outputs": {"regex": r" (19|20)[0-9]{2}"}})
    assert re.fullmatch(r" (19|20)[0-9]{2}", r.choices[0].text)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                     "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
    "required": ["a", "b"], "additionalProperties": False}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


def check_calls(calls, allowed: set[str]):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_tool_choice_required_and_named_always_parse(client, model):
    # No tool flags on this gateway: required and named need none (hermes format by default).
    c = client

    def required(seed):
        return c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the weather in Paris, and what is 2+3?"}],
            tools=[WEATHER, ADD], tool_choice="required", temperature=TEMP, seed=seed,
            # Room for several calls: with parallel calls allowed, SmolLM2 often writes more than one.
            max_tokens=240, parallel_tool_calls=seed % 2 == 0).choices[0]

    def named(seed):
        return c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Add some numbers."}], tools=[WEATHER, ADD],
            tool_choice={"type": "function", "function": {"name": "add"}}, temperature=TEMP, seed=seed,
            max_tokens=80).choices[0]

    with ThreadPoolExecutor(8) as pool:
        req = {s: pool.submit(required, s) for s in range(4)}
        nam = [pool.submit(named, s) for s in range(4)]
        for seed, f in req.items():
            ch = f.result()
            assert ch.finish_reason == "tool_calls"
            check_calls(ch.message.tool_calls, {"get_weather", "add"})
            if seed % 2:
                assert len(ch.message.tool_calls) == 1
        for f in nam:
            ch = f.result()
            check_calls(ch.message.tool_calls, {"add"})
            assert len(ch.message.tool_calls) == 1 and not ch.message.content


def test_streamed_tool_calls_arrive_in_openai_delta_shape(tc, model):
    stream = tc.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=TEMP, seed=11,
        max_tokens=80, stream=True)
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tcd in d.tool_calls or []:
            if tcd.index not in calls:
                # The first delta of a call names it: id, type and function name.
                assert tcd.id and tcd.type == "function" and tcd.function.name
                calls[tcd.index] = {"name": tcd.function.name, "arguments": tcd.function.arguments or ""}
            else:
                assert tcd.function.name is None
                calls[tcd.index]["arguments"] += tcd.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert "<tool_call>" not in content and "</tool_call>" not in content
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA_OF["get_weather"])


def test_tools_reach_the_chat_template(tc, model):
    template = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    msgs = [{"role": "user", "content": "Hi"}]
    without = tc.chat.completions.create(model=model, messages=msgs, max_tokens=1,
                                         extra_body={"chat_template": template})
    with_tools = tc.chat.completions.create(model=model, messages=msgs, max_tokens=1, tools=[WEATHER],
                                            tool_choice="none", extra_body={"chat_template": template})
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 20


def test_model_starting_inside_think_answers_in_reasoning(tc, model):
    msgs = [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "<think>"}]
    body = {"continue_final_message": True, "add_generation_prompt": False}
    r = tc.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0.0, extra_body=body)
    m = r.choices[0].message
    reasoning = m.model_extra.get("reasoning")
    assert reasoning and m.model_extra.get("reasoning_content") == reasoning
    stream = tc.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0.0,
                                        extra_body=body, stream=True)
    streamed, content = "", ""
    for chunk in stream:
        if chunk.choices:
            streamed += chunk.choices[0].delta.model_extra.get("reasoning") or ""
            content += chunk.choices[0].delta.content or ""
    assert streamed == reasoning and content == (m.content or "")


BAD = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
    {"extra_body": {"structured_outputs": {"regex": "[a-"}}},
    {"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}},
    {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_get_400_and_requests_in_flight_are_unaffected(client, model, stream):
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(client.chat.completions.create, model=model, temperature=0.0, max_tokens=24,
                           messages=[{"role": "user", "content": "Count to ten."}],
                           extra_body={"ignore_eos": True})
        for kw in BAD:
            with pytest.raises(openai.BadRequestError) as err:
                r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=8, stream=stream, **kw)
                if stream:
                    list(r)
            assert err.value.status_code == 400
            assert err.value.body and err.value.body.get("message")
        done = busy.result()
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 24


def test_auto_tool_choice_needs_the_flag(client, model):
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       tools=[WEATHER], tool_choice="auto")


QUESTIONS = ["What's the weather in Paris?", "What is the weather in Paris, and what is 2+3?", "What is 12 plus 30?"]


def streamed_calls(stream) -> tuple[str | None, list[tuple[str, str]]]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        if chunk.choices:
            for d in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", ""])
                call[0] += d.function.name or ""
                call[1] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    return finish, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("parallel", [None, False], ids=["parallel-default", "one-call"])
def test_required_tool_calls_end_with_tool_calls_and_never_repeat_a_call(client, model, parallel):
    # SmolLM2, held to the hermes format, used to write its call again and again until max_tokens.
    seeds = [11, 12, 13]
    print("seeds", seeds)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}

    def ask(case):
        question, seed, stream = case
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], tools=[WEATHER, ADD],
            tool_choice="required", temperature=TEMP, seed=seed, max_tokens=300, stream=stream, **extra)
        if stream:
            return streamed_calls(r)
        assert r.usage.completion_tokens < 300  # a repeat ends the generation, not only the list
        ch = r.choices[0]
        return ch.finish_reason, [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]

    cases = [(q, s, stream) for q in QUESTIONS for s in seeds for stream in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        results = dict(zip(cases, pool.map(ask, cases)))
    for (question, seed, stream), (finish, calls) in results.items():
        where = f"{question!r} seed {seed} stream {stream}: {finish} {calls}"
        assert finish == "tool_calls", where
        assert len(calls) == 1 if parallel is False else len(calls) >= 1, where
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])
        assert len({(n, json.dumps(json.loads(a), sort_keys=True)) for n, a in calls}) == len(calls), where
        if stream:  # the stream carries what the whole answer does
            assert results[(question, seed, False)] == (finish, calls), where


def test_a_schema_that_requires_itself_is_refused_before_the_engine(client, model, engine):
    schema = {"type": "object", "properties": {"nested_self": {"$ref": "#"}}, "required": ["nested_self"]}
    with pytest.raises(openai.BadRequestError, match="no finite JSON value") as err:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    with open(engine.log_path, errors="replace") as f:
        assert "nested_self" not in f.read()


def test_regex_digits_are_ascii_even_when_other_digits_are_likelier(gateway, client, model):
    # Bias the model hard towards U+1FBF8 SEGMENTED DIGIT EIGHT, a Unicode decimal digit.
    ids = httpx.post(gateway.url + "/tokenize", json={"model": model, "prompt": "\U0001FBF8"}).json()["tokens"]
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A phone number?"}], max_tokens=20, seed=seed,
            logit_bias={str(i): 30 for i in ids}, extra_body={"guided_regex": r"\d{3}-\d{4}"})
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content), r.choices[0].message.content
