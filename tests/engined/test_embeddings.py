"""Decoder embeddings and scores run through the engine's own step and equal mlx_lm's forward.

An embed request's vector is its last token's final normed hidden state,
L2-normalised (Qwen3-Embedding); a score request's value is
sigmoid(logit_yes - logit_no) at its last position (Qwen3-Reranker). Both are
prefill-only requests in the same scheduler, KV pool and packed step as
generation: chunked prompts, mixed batches and a mixed load with generation
must all give what a dense mlx_lm forward of the same tokens gives.
Float32 weights on the CPU backend.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import fresh_seed, make_tiny_model, seeded_rng

TOL = 1e-4
# One byte token each in the tiny vocabulary: the reranker's "no" and "yes".
SCORE_TOKENS = "n,y"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=fresh_seed("qwen3 model"))


def engine_for(path, task, **kw):
    config = dict(model=str(path), task=task, num_kv_blocks=64, block_size=16, max_num_batched_tokens=64,
                  score_tokens=SCORE_TOKENS)
    config.update(kw)
    return Engine(EngineConfig(**config))


def run(engine, requests):
    """requests: (id, tokens, task, params); returns {id: RequestOutput fields gathered}."""
    for rid, tokens, task, params in requests:
        engine.add_request(rid, tokens, params or SamplingParams(), task=task)
    got = {rid: {"tokens": [], "embedding": None, "score": None, "reason": None} for rid, *_ in requests}
    while any(g["reason"] is None for g in got.values()):
        assert not engine.take_errors()
        for out in engine.step():
            g = got[out.request_id]
            g["tokens"] += out.new_token_ids
            if out.finish_reason:
                g.update(reason=out.finish_reason, embedding=out.embedding, score=out.score)
    return got


def reference_hidden(model, tokens):
    """mlx_lm's final normed hidden state of the last token (the LM head's input)."""
    return model.model(mx.array(tokens)[None])[0, -1].astype(mx.float32)


def test_embeddings_equal_mlx_lm_last_token_pooling(qwen3):
    engine = engine_for(qwen3, "embed")
    reference = load_model(str(qwen3)).model
    rng = seeded_rng()
    # Lengths below, at and past the 64-token budget (chunked), together in one batch.
    prompts = {f"e{i}": rng.integers(0, 264, size=n).tolist() for i, n in enumerate((5, 16, 64, 150))}
    got = run(engine, [(rid, toks, "embed", None) for rid, toks in prompts.items()])
    assert engine.info.tasks == ["embed"] and engine.info.embedding_dim == 64
    for rid, toks in prompts.items():
        vec = np.frombuffer(got[rid]["embedding"], dtype="<f4")
        ref = np.asarray(reference_hidden(reference, toks))
        ref /= np.linalg.norm(ref)
        assert got[rid]["tokens"] == [] and got[rid]["reason"] == "stop"
        assert np.abs(vec - ref).max() < TOL, rid
        assert abs(np.linalg.norm(vec) - 1) < 1e-5
    # KV freed at finish: nothing is held but cached prefixes.
    assert not engine.scheduler.running and not engine.runner.kv.req_blocks


def test_scores_equal_mlx_lm_yes_no_probability(qwen3):
    engine = engine_for(qwen3, "score")
    reference = load_model(str(qwen3)).model
    vocab = engine.info.vocab_size
    no, yes = engine.score_ids
    rng = seeded_rng()
    prompts = {f"s{i}": rng.integers(0, 264, size=n).tolist() for i, n in enumerate((3, 40, 97))}
    got = run(engine, [(rid, toks, "score", None) for rid, toks in prompts.items()])
    for rid, toks in prompts.items():
        logits = reference(mx.array(toks)[None])[0, -1].astype(mx.float32)
        assert logits.shape == (vocab,)
        expected = 1 / (1 + np.exp(-(logits[yes].item() - logits[no].item())))
        assert abs(got[rid]["score"] - expected) < TOL, rid


def test_mixed_generation_and_embedding_load_equals_each_alone(qwen3):
    rng = seeded_rng()
    gen_prompts = [rng.integers(0, 264, size=n).tolist() for n in (7, 33, 90)]
    emb_prompts = [rng.integers(0, 264, size=n).tolist() for n in (12, 70, 25, 5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gen_reqs = [(f"g{i}", p, "generate", greedy) for i, p in enumerate(gen_prompts)]
    emb_reqs = [(f"e{i}", p, "embed", None) for i, p in enumerate(emb_prompts)]
    # Each kind alone on its own engine is the oracle for the mixed one.
    alone_gen = run(engine_for(qwen3, "generate"), gen_reqs)
    alone_emb = run(engine_for(qwen3, "embed"), emb_reqs)
    mixed = engine_for(qwen3, "embed")
    mixed.info.tasks.append("generate")  # the engine runs every task its info lists
    # Interleaved arrival: embeddings arrive while generations decode.
    got = run(mixed, [r for pair in zip(gen_reqs, emb_reqs) for r in pair] + emb_reqs[len(gen_reqs):])
    for rid, *_ in gen_reqs:
        assert got[rid]["tokens"] == alone_gen[rid]["tokens"], rid
    for rid, *_ in emb_reqs:
        a = np.frombuffer(got[rid]["embedding"], dtype="<f4")
        b = np.frombuffer(alone_emb[rid]["embedding"], dtype="<f4")
        assert np.abs(a - b).max() < TOL, rid


def test_wrong_task_is_refused_at_once(qwen3):
    engine = engine_for(qwen3, "generate")
    with pytest.raises(InvalidRequestError, match="serves generate requests, not embed"):
        engine.add_request("x", [1, 2, 3], SamplingParams(), task="embed")
    with pytest.raises(InvalidRequestError, match="unknown task"):
        engine.add_request("y", [1, 2, 3], SamplingParams(), task="pool")


def test_embed_prompt_may_fill_the_whole_context(qwen3):
    engine = engine_for(qwen3, "embed", max_model_len=32)
    got = run(engine, [("full", list(range(32)), "embed", None)])
    assert len(np.frombuffer(got["full"]["embedding"], dtype="<f4")) == 64
    with pytest.raises(Exception, match="maximum context length"):
        engine.add_request("over", list(range(33)), SamplingParams(), task="embed")


def test_matryoshka_dimensions_read_from_config(tmp_path):
    path = make_tiny_model(tmp_path / "m", "qwen3", seed=1, matryoshka_dimensions=[16, 32, 64])
    assert engine_for(path, "embed").info.matryoshka_dimensions == [16, 32, 64]
    path = make_tiny_model(tmp_path / "n", "qwen3", seed=1)
    assert engine_for(path, "embed").info.matryoshka_dimensions is None


def test_repeated_embedding_reuses_the_cached_prefix_and_is_counted(qwen3):
    engine = engine_for(qwen3, "embed")
    rng = seeded_rng()
    prompt = rng.integers(0, 264, size=50).tolist()
    first = run(engine, [("a", prompt, "embed", None)])["a"]["embedding"]
    engine.add_request("b", prompt, SamplingParams(), task="embed")
    outs = []
    while not outs or outs[-1].finish_reason is None:
        outs += engine.step()
    # The first request's three full blocks were kept cached after it finished.
    assert outs[-1].num_cached_tokens == 48
    assert np.abs(np.frombuffer(outs[-1].embedding, "<f4") - np.frombuffer(first, "<f4")).max() < TOL
    assert engine.metrics.pooled_requests["embed"]._value.get() == 2
    assert engine.metrics.total_prompt_tokens == 100
