"""SamplingParams.validate: every int the engine's sampler and the msgpack wire cannot hold is refused."""

from __future__ import annotations

import pytest

from mlxd.shared import protocol as p
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import INT64_MAX, INT64_MIN, SamplingParams

VOCAB = 1000


@pytest.mark.parametrize("field,value", [
    ("top_k", VOCAB + 1), ("top_k", 1 << 63), ("top_k", -2), ("seed", INT64_MAX + 1), ("seed", INT64_MIN - 1),
    ("max_tokens", 1 << 31), ("max_tokens", 0), ("repetition_penalty", 1e308), ("temperature", float("inf")),
    ("min_tokens", 17), ("stop_token_ids", [VOCAB]), ("logit_bias", {1 << 70: 1.0}), ("logprobs", 21),
])
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value}).validate(VOCAB)
    assert e.value.param == field


def test_the_extremes_allowed_travel_over_the_wire():
    params = SamplingParams(max_tokens=(1 << 31) - 1, top_k=VOCAB, seed=INT64_MIN, min_tokens=5,
                            stop_token_ids=[VOCAB - 1], logit_bias={VOCAB - 1: -100.0})
    params.validate(VOCAB)
    for seed in (INT64_MIN, INT64_MAX):
        params.seed = seed
        frames = p.encode(p.Kind.ADD, p.AddRequest("r", [1, 2], params, priority=INT64_MAX))
        assert p.decode(frames)[1].params == params
