"""Sliding-window layers' own K/V pool: billed apart from full context, holding only what is in view.

Tiny gemma3_text and gpt_oss models (layer 0 slides over 12 tokens, layer 1
is global; blocks of 8). The main pool is billed for the global layer only;
window blocks out of view are handed back as requests advance; logits still
equal mlx_lm's own forward far past the window and after resuming from a
cached prefix, and outputs are the same with prefix caching on and off.
"""

import numpy as np
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.kv.sliding_window import SlidingWindowGroup, first_visible_block, window_pool_blocks
from mlxd.engined.loaders import load_model
from mlxd.engined.request import Request
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.engined.test_hybrid import assert_close, drive
from tests.tiny_models import make_tiny_model, seeded_rng

WINDOW, BS = 12, 8
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["gemma3_text", "gpt_oss"])
def windowed(request, tmp_path_factory):
    seed = np.random.randint(1 << 30)
    print(f"{request.param}: model seed {seed}")
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=seed)
    return path, load_model(str(path)).model


def window_group(engine) -> SlidingWindowGroup:
    (group,) = [g for g in engine.scheduler.kv.groups if isinstance(g, SlidingWindowGroup)]
    return group


def held(engine, req):
    return [b for b in window_group(engine).tables[req.request_id] if b is not None]


def test_main_pool_billed_for_global_layers_only(windowed):
    path, _ = windowed
    config = EngineConfig(block_size=BS, kv_cache_memory=1 << 20, max_model_len=256, max_num_seqs=4)
    engine = Engine(config, loaded=load_model(str(path)))
    kv, window = engine.scheduler.kv, window_group(engine)
    assert window.layers == [0] and kv.main.layers == [1]
    per_layer = 2 * BS * 2 * 16 * 4  # K and V, block of 8, 2 KV heads of 16, float32
    assert kv.bytes_per_block == per_layer
    assert kv.pool.num_blocks == min((1 << 20) // per_layer, 4 * 256 // BS)
    assert window.num_blocks == window_pool_blocks(WINDOW, BS, 4, engine.config.max_num_batched_tokens)
    assert engine.memory.fixed_bytes == window.num_blocks * per_layer
    assert window.kv.k[0].shape[0] == window.num_blocks
    assert kv.main.kv.k[0].shape[0] == kv.pool.num_resident == 256 // BS  # one full request's, at start


def test_logits_far_past_the_window_and_after_a_cached_prefix(windowed):
    path, reference = windowed
    engine = Engine(EngineConfig(num_kv_blocks=64, block_size=BS), loaded=load_model(str(path)))
    rng = seeded_rng()
    a = Request("a", rng.integers(0, 256, size=70).tolist(), GREEDY, 0)
    d = Request("d", rng.integers(0, 256, size=40).tolist(), GREEDY, 0)
    steps = [[(a, 13), (d, 30)], [(a, 20), (d, 9)], [(a, 20)], [(a, 16), (d, 1)]]
    logits = drive(engine, steps)
    assert_close(logits[0], reference, a.token_ids[:69])
    assert_close(logits[1], reference, d.token_ids)
    # a is at 69 computed tokens: it holds only the blocks from the first it can still see.
    first = first_visible_block(69, WINDOW, BS)
    assert window_group(engine).tables["a"][:first] == [None] * first
    assert len(held(engine, a)) == -(-69 // BS) - first
    engine.scheduler.kv.free(a)

    b_tokens = a.token_ids[:52] + rng.integers(0, 256, size=9).tolist()
    b = Request("b", b_tokens, GREEDY, 0)
    prefix = engine.scheduler.kv.cached_prefix(b)
    assert len(prefix) == 52 // BS  # 48 tokens; the window blocks its next token sees are cached
    assert engine.scheduler.kv.allocate(b, len(b_tokens) - 48, prefix)
    b.num_computed_tokens = 48
    logits = drive(engine, [[(b, len(b_tokens) - 48)]])
    assert_close(logits[0], reference, b_tokens)


def test_window_blocks_handed_back_as_requests_advance(windowed):
    path, _ = windowed
    config = EngineConfig(num_kv_blocks=128, block_size=BS, max_num_seqs=6, max_num_batched_tokens=32)
    engine = Engine(config, loaded=load_model(str(path)))
    rng = seeded_rng()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", rng.integers(0, 256, size=int(rng.integers(5, 60))).tolist(), params)
    bound = -(-(WINDOW - 1) // BS) + 2
    window = window_group(engine)
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        for req in running:
            assert len(held(engine, req)) <= bound
        # Every window block is held by exactly the running requests' tables, or free.
        in_use = {b.block_id for r in running for b in held(engine, r)}
        assert window.pool.num_free == window.num_blocks - len(in_use)
        assert set(window.tables) <= {r.request_id for r in running}
    assert engine.scheduler.num_preemptions == 0
    window.pool.check_whole()
    engine.scheduler.kv.pool.check_whole()


def test_outputs_equal_with_prefix_caching_on_and_off(windowed):
    path, _ = windowed
    rng = seeded_rng()
    system = rng.integers(0, 256, size=45).tolist()
    prompts = [system + rng.integers(0, 256, size=int(n)).tolist() for n in (3, 9, 17)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        config = EngineConfig(num_kv_blocks=96, block_size=BS, max_num_batched_tokens=24, enable_prefix_caching=caching)
        engine = Engine(config, loaded=load_model(str(path)))
        results[caching] = [engine.generate([p], params) for p in prompts] + [engine.generate(prompts, params)]
        if caching:
            assert engine.stats().prefix_cache_hits >= 40 * 3
    assert results[True] == results[False]
