"""A packed step whose requests' adapters come in any order: whatever the step holds (prefill chunks sampling
nothing, draft rows, a step in flight whose tokens fill the next), each request's tokens equal its own single
run."""

import json

import numpy as np
import pytest

from mlxd.engined.engine import Engine
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.engined.test_lora import _engine, _load, setups  # noqa: F401 (the fixture)
from tests.tiny_models import fresh_seed

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})


def _prompts(n: int):
    rng = np.random.default_rng(fresh_seed("mixed steps"))
    # Repeating prompts, so that ngram speculation finds drafts; lengths over the 16-token budget, so that
    # prefills are chunked beside decoding requests.
    return [(rng.integers(0, 256, int(rng.integers(3, 6))).tolist() * 8)[: int(rng.integers(10, 40))]
            for _ in range(n)]


@pytest.mark.parametrize("extra", [dict(async_scheduling=True), dict(speculative_config=NGRAM)],
                         ids=["async", "ngram"])
def test_mixed_steps_give_each_request_its_single_run(setups, extra):
    model_dir, a_dir, b_dir, _ = setups("llama")
    prompts = _prompts(8)
    loras = ["B", None, "A", "B", None, "A", "A", "B"]  # adapters and the base interleaved
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = _engine(model_dir, "float32", a_dir, b_dir)
    want = [alone.generate([p], params, [lora])[0] for p, lora in zip(prompts, loras)]
    engine = Engine(EngineConfig(num_kv_blocks=96, block_size=8, max_num_batched_tokens=16, max_num_seqs=8,
                                 enable_lora=True, max_loras=2, max_lora_rank=8,
                                 lora_modules=[f"A={a_dir}", f"B={b_dir}"], **extra), _load(model_dir, "float32"))
    assert engine.generate(prompts, params, loras) == want
    if "speculative_config" in extra:  # steps with several logits rows per request
        assert engine.metrics.spec_draft_tokens._value.get() > 0


def test_embeddings_of_a_mixed_step_are_each_requests_own(setups):
    """The hidden rows (an embed request's result) of a mixed step are each request's own."""
    model_dir, a_dir, b_dir, _ = setups("llama")
    engine = Engine(EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=256, task="embed",
                                 enable_lora=True, max_loras=2, max_lora_rank=8,
                                 lora_modules=[f"A={a_dir}", f"B={b_dir}"]), _load(model_dir, "float32"))
    prompts, loras = _prompts(4), ["B", None, "A", "B"]

    def embed(pairs):
        for i, (prompt, lora) in enumerate(pairs):
            engine.add_request(f"e{i}", prompt, SamplingParams(max_tokens=1), lora_name=lora, task="embed")
        got = {}
        while engine.has_unfinished():
            got.update({o.request_id: np.frombuffer(o.embedding, "<f4") for o in engine.step() if o.embedding})
        return [got[f"e{i}"] for i in range(len(pairs))]

    together = embed(list(zip(prompts, loras)))
    alone = [embed([(p, lora)])[0] for p, lora in zip(prompts, loras)]
    for got, want in zip(together, alone):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.allclose(together[0], together[1], atol=1e-3)
