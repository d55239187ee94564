"""vLLM's extra request fields and the openai SDK's models.retrieve: each honoured, or a 400, never ignored."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Pick a digit."}]


def test_models_retrieve_names_the_served_model_and_404s_others(client, model):
    m = client.models.retrieve(model)
    assert m.id == model and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("some-org/other-model")


@pytest.mark.parametrize("field,value,check", [
    ("guided_json", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("guided_json", json.dumps(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("guided_regex", "[0-9]{2}", lambda t: len(t) == 2 and t.isdigit() or pytest.fail(t)),
    ("guided_choice", ["red", "blue"], lambda t: t in ("red", "blue") or pytest.fail(t)),
    ("guided_grammar", 'start: "x" ("y" | "zz")', lambda t: t in ("xy", "xzz") or pytest.fail(t)),
])
def test_guided_aliases_constrain_as_structured_outputs_do(client, model, field, value, check):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=20, temperature=0.7, seed=3,
                                       extra_body={field: value})
    assert r.choices[0].finish_reason == "stop"
    check(r.choices[0].message.content)


def test_response_format_on_completions(client, model):
    r = client.completions.create(model=model, prompt="A digit as JSON: ", max_tokens=20, temperature=0.7, seed=5,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "d", "schema": SCHEMA}}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize("extra,param", [
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"bad_words": ["no"]}, "bad_words"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_fields_not_honoured_are_400s(gateway, model, extra, param):
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hi"})):
        r = httpx.post(gateway.url + path, json={"model": model, "max_tokens": 2, **body, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, model):
    long = "one two three four five six seven eight nine ten " * 80  # over the 512-token context
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=long, max_tokens=2)
    r = client.completions.create(model=model, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": 100})
    assert r.usage.prompt_tokens == 100
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": long}], max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 300})
    assert chat.usage.prompt_tokens == 300
