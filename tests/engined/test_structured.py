"""Constrained decoding in the in-process Engine on the real SmolLM2 GGUF (llguidance matchers)."""

import json
import logging
import re
import time

import jsonschema
import pytest
from transformers import AutoTokenizer

from mlxd.engined.engine import Engine
from mlxd.engined.speculation.speculator import can_speculate
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import SamplingParams, StructuredSpec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    # n-gram speculation on: every test here also runs constrained requests through it.
    e = Engine(EngineConfig(num_kv_blocks=400, max_num_batched_tokens=256, max_num_seqs=16,
                            speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'))
    yield e
    e.grammars.shutdown()


@pytest.fixture(scope="module")
def tokenizer(engine):
    return AutoTokenizer.from_pretrained(engine.info.tokenizer_dir)


def chat_ids(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def params(kind, spec="", **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 1.0)
    return SamplingParams(structured=StructuredSpec(kind, spec), **kw)


def text_of(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_json_schema_outputs_validate_at_temperature_one(engine, tokenizer):
    prompts = [chat_ids(tokenizer, f"Describe user number {i} as JSON.") for i in range(8)]
    outs = engine.generate(prompts, [params("json_schema", json.dumps(PERSON), seed=i) for i in range(8)])
    for out in outs:
        jsonschema.validate(json.loads(text_of(tokenizer, out)), PERSON)


def test_matcher_completion_stops_the_request_without_max_tokens(engine, tokenizer):
    # The choice is complete after its last token: the request ends there with "stop".
    rid = "choice-stop"
    engine.add_request(rid, chat_ids(tokenizer, "Pick a colour."), params("choice", '["red", "green", "blue"]',
                                                                           max_tokens=50))
    finish, ids = None, []
    while finish is None:
        for out in engine.step():
            if out.request_id == rid:
                ids += out.new_token_ids
                finish = out.finish_reason
    assert finish == "stop"
    assert text_of(tokenizer, ids) in ("red", "green", "blue")


def test_regex_and_choice_are_honoured(engine, tokenizer):
    prompts = [chat_ids(tokenizer, "Give me a date."), chat_ids(tokenizer, "Yes or no?")] * 3
    ps = [params("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", seed=1),
          params("choice", '["yes", "no", "maybe"]', seed=2)] * 3
    outs = engine.generate(prompts, ps)
    for i, out in enumerate(outs):
        text = text_of(tokenizer, out)
        if i % 2 == 0:
            assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", text), text
        else:
            assert text in ("yes", "no", "maybe")


def test_lark_grammar_and_json_object(engine, tokenizer):
    lark = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    a, b = engine.generate([chat_ids(tokenizer, "What is 6 times 7?"), chat_ids(tokenizer, "Some JSON please")],
                           [params("grammar", lark, temperature=0.0), params("json_object", seed=3, max_tokens=60)])
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text_of(tokenizer, a))
    text = text_of(tokenizer, b)
    # json_object bounds nothing but the shape: if it ended by itself it is a whole object.
    if len(b) < 60:
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize("kind,spec", [
    ("json_schema", '{"type": "nonsense"}'),
    ("json_schema", "not json"),
    ("regex", "[a-"),
    ("choice", "[]"),
    ("grammar", "start: undefined_rule"),
])
def test_invalid_grammar_fails_the_request_with_400_and_others_finish(engine, tokenizer, kind, spec):
    prompt = chat_ids(tokenizer, "Hello")
    with pytest.raises(InvalidRequestError) as err:
        engine.generate([prompt, prompt], [params(kind, spec), SamplingParams(max_tokens=4, temperature=0.0)])
    assert err.value.status == 400
    # The good request of the same batch was not disturbed: run it to the end.
    while engine.has_unfinished():
        engine.step()
    assert not engine.requests
    engine.scheduler.kv.pool.check_whole()


def test_compiling_grammar_does_not_hold_back_other_requests(engine, tokenizer):
    # A large enum compiles for longer than a step takes: the plain request
    # queued behind it must get tokens while it compiles.
    big = {"enum": [f"value-{i}-" + "x" * (i % 13) for i in range(20000)]}
    engine.add_request("slow-grammar", chat_ids(tokenizer, "Pick"), params("json_schema", json.dumps(big),
                                                                          max_tokens=20))
    engine.add_request("plain", chat_ids(tokenizer, "Hi"), SamplingParams(max_tokens=6, temperature=0.0,
                                                                           ignore_eos=True))
    compiling = engine.requests["slow-grammar"].grammar.future
    plain_tokens_while_compiling = 0
    finished = {}
    t0 = time.monotonic()
    while len(finished) < 2 and time.monotonic() - t0 < 120:
        was_compiling = not compiling.done()
        for out in engine.step():
            if out.request_id == "plain" and was_compiling:
                plain_tokens_while_compiling += len(out.new_token_ids)
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
    assert finished == {"plain": "length", "slow-grammar": "stop"}
    assert plain_tokens_while_compiling > 0


def test_constrained_requests_may_speculate_unless_opted_out(engine, tokenizer):
    engine.add_request("c", chat_ids(tokenizer, "x"), params("json_object"))
    engine.add_request("off", chat_ids(tokenizer, "x"), params("json_object", speculate=False))
    assert can_speculate(engine.requests["c"])
    assert not can_speculate(engine.requests["off"])
    engine.abort(["c", "off"])
    while engine.has_unfinished():
        engine.step()


def test_unknown_kind_is_refused_at_once(engine, tokenizer):
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad-kind", chat_ids(tokenizer, "x"), params("xml"))
    assert "bad-kind" not in engine.requests


def test_a_grammar_failing_mid_generation_logs_its_request_id_and_never_its_text(engine, tokenizer, caplog):
    # The gateway refuses this schema (no finite value); sent to the engine as is, llguidance
    # accepts it and fails on the first token. The log must say which request, not what grammar.
    schema = json.dumps({"type": "object", "properties": {"secret_field": {"$ref": "#"}},
                         "required": ["secret_field"]})
    caplog.set_level(logging.WARNING, logger="mlxd")
    engine.add_request("endless-schema", chat_ids(tokenizer, "x"), params("json_schema", schema, max_tokens=20))
    finish = None
    while finish is None:
        for out in engine.step():
            if out.request_id == "endless-schema":
                finish = out.finish_reason
    lines = [r.getMessage() for r in caplog.records]
    assert any("endless-schema" in line for line in lines), lines
    assert not any("secret_field" in line or "$ref" in line for line in lines), lines
