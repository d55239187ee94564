"""Automatic prefix caching: same outputs, only new tokens computed, isolation by salt, no leaks."""

import numpy as np
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7, max_position_embeddings=8192)


def tiny_engine(tiny_dir, **kw):
    cfg = dict(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=512, max_num_seqs=16)
    return Engine(EngineConfig(**{**cfg, **kw}), loaded=load_model(str(tiny_dir)))


def run(engine, prompts, params=GREEDY, salts=None):
    """Run prompts together; returns (outputs, cached token counts) in order."""
    ids = [f"p{run.counter + i}" for i in range(len(prompts))]
    run.counter += len(prompts)
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, p, params, cache_salt=salts[i] if salts else None)
    toks = {rid: [] for rid in ids}
    cached = {}
    while engine.has_unfinished():
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    return [toks[r] for r in ids], [cached[r] for r in ids]


run.counter = 0


def test_outputs_identical_with_caching_on_and_off_smollm2():
    rng = np.random.default_rng(0)
    system = rng.integers(100, 40000, size=160).tolist()  # ten blocks: hits, and a prefill a CPU does quickly
    questions = [rng.integers(100, 40000, size=int(n)).tolist() for n in rng.integers(5, 60, size=9)]
    batches = [[0], [1, 2, 3], [0, 4], [5, 6, 7, 8, 1]]  # repeats and partial overlaps across batches
    results = {}
    for caching in (True, False):
        eng = Engine(EngineConfig(num_kv_blocks=400, max_num_batched_tokens=256, enable_prefix_caching=caching))
        results[caching] = [run(eng, [system + questions[q] for q in batch]) for batch in batches]
        stats = eng.stats()
        eng.scheduler.kv.pool.check_whole()
        if caching:
            assert stats.prefix_cache_hits > 0
        del eng
    for (on_out, on_cached), (off_out, off_cached) in zip(results[True], results[False]):
        assert on_out == off_out
        assert all(c == 0 for c in off_cached)
    assert any(c > 0 for _, cached in results[True][1:] for c in cached)


def test_multi_turn_agent_session_computes_only_new_tokens(tiny_dir):
    eng = tiny_engine(tiny_dir)
    rng = np.random.default_rng(1)
    bs = eng.info.block_size
    history = rng.integers(1, 260, size=2048).tolist()  # ~2K-token shared system prompt with tools
    prev_total = None
    for turn in range(10):
        new_user = rng.integers(1, 260, size=int(rng.integers(20, 120))).tolist()
        prompt = history + new_user
        before = eng.stats()
        (out,), (cached,) = run(eng, [prompt], SamplingParams(max_tokens=int(rng.integers(5, 40)),
                                                               temperature=0.0, ignore_eos=True))
        computed = len(prompt) - cached
        hits = eng.stats().prefix_cache_hits - before.prefix_cache_hits
        assert hits == cached
        if turn > 0:
            new_tokens = len(prompt) - prev_total
            assert new_tokens <= computed <= new_tokens + bs, (turn, new_tokens, computed)
            assert cached >= len(prompt) - new_tokens - bs
        history = prompt + out
        prev_total = len(history)
    eng.scheduler.kv.pool.check_whole()


def test_eviction_under_pressure_completes_and_degrades_gracefully(tiny_dir):
    rng = np.random.default_rng(2)
    shared = rng.integers(1, 260, size=96).tolist()
    sessions = [shared + rng.integers(1, 260, size=160).tolist() for _ in range(8)]
    rates = {}
    for blocks in (512, 48):  # 48 blocks of 16 hold about 3 of the 8 sessions
        eng = tiny_engine(tiny_dir, num_kv_blocks=blocks, max_num_seqs=4)
        for _ in range(3):
            outs, _ = run(eng, sessions, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            assert all(len(o) == 8 for o in outs)
        s = eng.stats()
        rates[blocks] = s.prefix_cache_hits / s.prefix_cache_queries
        eng.scheduler.kv.pool.check_whole()
    assert rates[512] > rates[48] > 0.0  # the hot shared prefix keeps hitting under pressure


def test_salted_requests_never_share_blocks(tiny_dir):
    eng = tiny_engine(tiny_dir)
    prompt = np.random.default_rng(3).integers(1, 260, size=200).tolist()
    _, (first,) = run(eng, [prompt], salts=["app-a"])
    _, (other_salt,) = run(eng, [prompt], salts=["app-b"])
    _, (unsalted,) = run(eng, [prompt])
    _, (same_salt,) = run(eng, [prompt], salts=["app-a"])
    assert first == 0 and other_salt == 0 and unsalted == 0
    assert same_salt == 192  # 12 full blocks; the last token is always recomputed
    # The salted chains are disjoint: no hash of salt b's blocks equals one of salt a's.
    eng.add_request("a", prompt, GREEDY, cache_salt="app-a")
    eng.add_request("b", prompt, GREEDY, cache_salt="app-b")
    eng.step()
    assert not set(eng.scheduler.kv.block_ids("a")) & set(eng.scheduler.kv.block_ids("b"))
    eng.abort(["a", "b"])
    eng.step()
    eng.scheduler.kv.pool.check_whole()


def test_abort_of_one_sharer_leaves_the_other_intact(tiny_dir):
    eng = tiny_engine(tiny_dir)
    prompt = np.random.default_rng(4).integers(1, 260, size=100).tolist()
    (alone,), _ = run(eng, [prompt])
    eng.add_request("keep", prompt, GREEDY)
    eng.add_request("drop", prompt, GREEDY)
    tokens = []
    for i in range(30):
        if i == 2:
            eng.abort(["drop"])
        for out in eng.step():
            if out.request_id == "keep":
                tokens += out.new_token_ids
        if not eng.has_unfinished():
            break
    assert tokens == alone
    eng.scheduler.kv.pool.check_whole()
