"""Sampling defaults: the model's generation_config.json, the operator's override, and the output cap."""

from __future__ import annotations

import json

import msgspec
import pytest

from mlxd.gateway import openai_types as t
from mlxd.gateway import params as P
from mlxd.gateway.params import SamplingDefaults, sampling_defaults
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.serve_config import GatewayConfig

QWEN_LIKE = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2],
             "bos_token_id": 0}


def model_dir(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_reads_the_models_sampling_keys_and_the_override_wins(tmp_path):
    d = model_dir(tmp_path, QWEN_LIKE)
    assert sampling_defaults("auto", d, {}) == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    override = GatewayConfig(override_generation_config='{"temperature": 0.2, "max_new_tokens": 64}')
    got = sampling_defaults("auto", d, override.generation_override)
    assert got == SamplingDefaults(temperature=0.2, top_p=0.95, top_k=20, max_tokens=64)
    assert sampling_defaults("vllm", d, {}) == SamplingDefaults()
    assert sampling_defaults("auto", str(tmp_path / "none"), {}) == SamplingDefaults()
    assert sampling_defaults(d, "/elsewhere", {}).temperature == 0.6  # a folder named outright
    with pytest.raises(InvalidRequestError):
        sampling_defaults(str(tmp_path / "none"), d, {})
    with pytest.raises(InvalidRequestError):
        sampling_defaults("auto", model_dir(tmp_path, {"temperature": "hot"}), {})


@pytest.mark.parametrize("text", ['{"max_new_tokens": 0}', '{"temprature": 0.5}', "[1]", "{", '{"top_k": 1.5}'])
def test_a_bad_override_stops_the_gateway_at_start_up(text):
    with pytest.raises(InvalidRequestError):
        GatewayConfig(override_generation_config=text)


def request(**fields) -> t.ChatCompletionRequest:
    return msgspec.json.decode(json.dumps({"messages": [], **fields}), type=t.ChatCompletionRequest)


def test_omitted_fields_take_the_defaults_and_the_cap_holds_every_request():
    d = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=64)
    p = P.sampling_params(request(), 5000, None, 100, defaults=d)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (0.6, 0.95, 20, 0.05, 1.1, 64)
    own = P.sampling_params(request(temperature=0.0, top_p=0.5, top_k=3, min_p=0.0, repetition_penalty=1.0),
                            10, None, 100, defaults=d)
    assert (own.temperature, own.top_p, own.top_k, own.min_p, own.repetition_penalty, own.max_tokens) == \
        (0.0, 0.5, 3, 0.0, 1.0, 10)
    plain = P.sampling_params(request(), 5000, None, 100)
    assert (plain.temperature, plain.top_p, plain.max_tokens) == (1.0, 1.0, 5000)
