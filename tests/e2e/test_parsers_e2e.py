"""Parsers picked from the chat template, through the real openai SDK, gateway and engine on loopback.

A gateway started with ``--tool-call-parser auto`` and a chat template that
writes GLM-4.5's or Gemma 4's tool calls reads calls in that format, and
holds required and named tool choice to it: SmolLM2, sampling at
temperature, answers in the format and the calls come back whole and
streamed with arguments that validate.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.servers import Gateway

# Templates of our own that write each family's markers (the detection reads only those).
TEMPLATES = {
    "glm45": ("{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{%- endfor %}"
              "{%- if tools %}<|system|>\nCall a tool as <tool_call>name\n<arg_key>key</arg_key>\n"
              "<arg_value>value</arg_value></tool_call>{%- endif %}"
              "{%- if add_generation_prompt %}<|assistant|>\n<think></think>\n{%- endif %}"),
    "gemma4": ("{%- for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{%- endfor %}"
               "{%- if tools %}<|turn>system\nCall a tool as <|tool_call>call:name{key:value}<tool_call|>"
               "<turn|>\n{%- endif %}"
               "{%- if add_generation_prompt %}<|turn>model\n<|channel>thought\n<channel|>{%- endif %}"),
}
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["tz"], "additionalProperties": False}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (FORECAST, CLOCK)}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family_gateway(request, engine, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp("templates") / f"{family}.jinja"
    path.write_text(TEMPLATES[family])
    log = tmp_path_factory.mktemp("logs") / f"gateway-{family}.log"
    g = Gateway(engine.endpoint, str(log), extra=["--chat-template", str(path), "--enable-auto-tool-choice",
                                                   "--tool-call-parser", "auto", "--reasoning-parser", "auto"])
    g.start()
    g.wait_healthy()
    yield family, g, log
    g.stop()


def validate(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


def test_auto_parsers_read_required_and_named_calls_whole_and_streamed(family_gateway):
    family, g, log = family_gateway
    client = openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=180)
    model = client.models.list().data[0].id
    reasoning = {"glm45": "think", "gemma4": "gemma4"}[family]
    assert f"parsers: tool calls {family} (tool choice format {family}), reasoning {reasoning}" in log.read_text()
    messages = [{"role": "user", "content": "Weather in Oslo for three days, and the time?"}]
    ch = client.chat.completions.create(model=model, messages=messages, tools=[FORECAST, CLOCK],
                                        tool_choice="required", temperature=0.7, seed=1, max_tokens=120,
                                        parallel_tool_calls=False).choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.id and call.type == "function"
    validate(call.function.name, call.function.arguments)
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=[FORECAST, CLOCK], temperature=0.7, seed=5, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "forecast"}}, stream=True)
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tcd in d.tool_calls or []:
            if tcd.index not in calls:
                assert tcd.id and tcd.function.name
                calls[tcd.index] = [tcd.function.name, tcd.function.arguments or ""]
            else:
                calls[tcd.index][1] += tcd.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not content.strip()
    assert [c[0] for c in calls.values()] == ["forecast"]
    validate(*calls[0])
