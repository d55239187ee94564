"""Speculation on hybrid models: rejected drafts are taken back out of the recurrent state.

Tiny random-weight qwen3_next / qwen3_5 models. A verification window runs
through the gated delta nets position by position; the state after each
position is kept and the accepted one restored. Greedy outputs must equal
plain decoding on mixed batches (speculating, opted out, prefilling) with
prefix caching on, with drafts both accepted and rejected.
"""

import numpy as np
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.kv.recurrent_state import RecurrentStateGroup
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import make_tiny_model, seeded_rng

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
KW = dict(num_kv_blocks=256, block_size=8, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def hybrid(request, tmp_path_factory):
    seed = np.random.randint(1 << 30)
    print(f"{request.param}: model seed {seed}")
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=seed)


# A few tokens biased far above the rest: the greedy output is a walk over them, whose
# n-grams recur, so n-gram drafts are accepted at times and rejected at others.
NARROW = {t: 30.0 for t in (10, 11, 12, 13)}


def spec_counts(engine: Engine) -> tuple[float, float]:
    return engine.metrics.spec_draft_tokens._value.get(), engine.metrics.spec_accepted._value.get()


def test_greedy_outputs_with_ngram_speculation_equal_plain_decoding_on_hybrids(hybrid):
    rng = seeded_rng()
    plain = Engine(EngineConfig(**KW), loaded=load_model(str(hybrid)))
    spec = Engine(EngineConfig(**KW, speculative_config=NGRAM), loaded=load_model(str(hybrid)))
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in (6, 11, 19, 30)]
    shared = prompts[3][:17]  # a prefix two requests share: the second resumes from its snapshot
    prompts += [shared + [3, 4, 5], shared + [9, 9]]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculate=i != 2,
                             logit_bias=NARROW if i != 1 else None) for i in range(len(prompts))]
    expected = plain.generate(prompts, params)
    assert spec.generate(prompts, params) == expected
    hits = spec.stats().prefix_cache_hits
    for i in (4, 5, 0):  # alone, in slots others used; 5 resumes from 4's snapshot of their prefix
        assert spec.generate([prompts[i]], params[i]) == [expected[i]]
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted, (drafted, accepted)  # both accepted and rejected drafts were taken back
    assert spec.stats().prefix_cache_hits >= hits + 16
    states = next(g for g in spec.scheduler.kv.groups if isinstance(g, RecurrentStateGroup))
    assert states.live == {} and not states.windows and not states.restores
    # The window slots (k per live slot) are part of the fixed pool the memory guard set aside.
    assert states.nbytes == (8 * (1 + 3) + 8) * states.bytes_per_slot == spec.memory.fixed_bytes
    spec.scheduler.kv.pool.check_whole()


def test_greedy_outputs_with_a_draft_model_equal_plain_decoding_on_hybrids(hybrid, tmp_path):
    rng = seeded_rng()
    # A dense draft of the same vocabulary; random, so its drafts are mostly rejected.
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=int(rng.integers(1 << 30)))
    cfg = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 2}}'
    plain = Engine(EngineConfig(**KW), loaded=load_model(str(hybrid)))
    spec = Engine(EngineConfig(**KW, speculative_config=cfg), loaded=load_model(str(hybrid)))
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in (9, 20, 33)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert spec.generate(prompts, params) == plain.generate(prompts, params)
    drafted, _ = spec_counts(spec)
    assert drafted > 0
