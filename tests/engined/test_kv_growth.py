"""A KV pool whose resident size follows demand: grown in doubling steps up to the planned capacity,
never evicting a cached prefix while it can still grow, cut back after idle, same outputs throughout."""

import gc

import mlx.core as mx
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.kv.manager import IDLE_RELEASE_S, BlockPool
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import make_tiny_model, seeded_rng

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BS = 16
MAX_LEN = 256  # one full request: 16 blocks, the resident size at start


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=11, max_position_embeddings=4096)


def tiny_engine(tiny_dir, **kw):
    cfg = dict(block_size=BS, max_model_len=MAX_LEN, max_num_batched_tokens=256, max_num_seqs=16,
               kv_cache_memory=8 << 20)
    return Engine(EngineConfig(**{**cfg, **kw}), loaded=load_model(str(tiny_dir)))


def prompts(rng, n, shared=0):
    head = rng.integers(1, 250, size=shared).tolist()
    return [head + rng.integers(1, 250, size=int(k)).tolist() for k in rng.integers(40, 200, size=n)]


def assert_arrays_match_pool(engine):
    kv = engine.scheduler.kv
    assert all(a.shape[0] == kv.pool.num_resident for a in kv.main.kv.arrays())
    assert kv.nbytes == kv.pool.num_resident * kv.bytes_per_block


# -- the block pool alone --------------------------------------------------------------------


def test_pool_grows_by_doubling_to_its_capacity_and_admission_sees_all_of_it():
    pool = BlockPool(40, 8)
    assert (pool.num_blocks, pool.num_resident, pool.num_free) == (40, 8, 40)
    a = pool.allocate(8)
    assert pool.num_resident == 8 and [b.block_id for b in a] == list(range(8))
    b = pool.allocate(1)
    assert pool.num_resident == 16 and b[0].block_id == 8
    c = pool.allocate(20)
    assert pool.num_resident == 32 and pool.num_free == 40 - 29
    d = pool.allocate(11)
    assert pool.num_resident == 40 and pool.num_free == 0  # capped at the capacity, never past it
    assert sorted(x.block_id for x in a + b + c + d) == list(range(40))
    pool.free(reversed(a + b + c + d))
    pool.check_whole()


def test_no_cached_prefix_is_evicted_while_the_pool_can_still_grow():
    pool = BlockPool(16, 4)
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks):
        pool.cache(blk, bytes([i]) * 16)
    pool.free(reversed(blocks))  # all four free but cached
    fresh = pool.allocate(2)
    assert pool.num_resident == 8 and {b.block_id for b in fresh} == {4, 5}
    assert all(pool.lookup(bytes([i]) * 16) is blocks[i] for i in range(4))
    pool.allocate(10)  # 2 fresh left, grown to 16: still no eviction
    assert pool.num_resident == 16 and len(pool.cached) == 4 and pool.num_free == 4
    pool.allocate(1)  # only now, at capacity, does LRU eviction take the oldest cached block
    assert len(pool.cached) == 3 and pool.lookup(bytes([3]) * 16) is None


def test_shrink_keeps_held_blocks_and_drops_cached_ones_past_the_cut():
    pool = BlockPool(32, 4)
    held = pool.allocate(20)  # more than doubling gives: grown by what was short
    assert pool.num_resident == 20
    for blk in held:
        pool.cache(blk, blk.block_id.to_bytes(2, "little") * 8)
    pool.free(reversed(held[:10]))
    pool.free(reversed(held[12:]))
    assert pool.shrink(4) == 12  # blocks 10 and 11 are still held
    assert sorted(b.block_id for b in pool.blocks) == list(range(12))
    assert all(b.block_id < 12 for b in pool.cached.values()) and len(pool.cached) == 12
    pool.free(reversed(held[10:12]))
    assert pool.shrink(4) == 4 and len(pool.cached) == 4
    pool.check_whole()
    assert pool.num_free == 32


# -- the engine ------------------------------------------------------------------------------


def test_a_growing_pool_serves_what_a_fully_allocated_one_does(tiny_dir):
    rng = seeded_rng()
    batch = prompts(rng, 24, shared=48)
    growing = tiny_engine(tiny_dir)
    kv = growing.scheduler.kv
    assert kv.pool.num_resident == MAX_LEN // BS < kv.pool.num_blocks
    assert_arrays_match_pool(growing)

    full = tiny_engine(tiny_dir)
    full.scheduler.kv.create(full.memory.num_blocks)  # every block resident from the start
    assert full.scheduler.kv.pool.num_resident == full.memory.num_blocks

    assert growing.generate(batch, GREEDY) == full.generate(batch, GREEDY)
    assert MAX_LEN // BS < kv.pool.num_resident <= kv.pool.num_blocks == growing.memory.num_blocks
    assert_arrays_match_pool(growing)
    kv.pool.check_whole()
    # The same prompts again hit the prefix cache grown while serving them.
    again = growing.generate(batch[:4], GREEDY)
    assert again == full.generate(batch[:4], GREEDY)
    assert kv.hits > 0


def test_growth_stays_inside_the_budget(tiny_dir):
    budget = 4 << 20
    # The peak is the process's: what earlier tests left alive counts in it, so measure from here.
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    e = tiny_engine(tiny_dir, kv_cache_memory=budget, max_num_seqs=32)
    kv, m = e.scheduler.kv, e.memory
    assert m.num_blocks * kv.bytes_per_block <= budget
    rng = seeded_rng()
    mx.clear_cache()
    mx.reset_peak_memory()
    for _ in range(2):
        outs = e.generate(prompts(rng, 40), SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        assert [len(o) for o in outs] == [48] * 40
        assert kv.pool.num_resident <= m.num_blocks
    assert kv.pool.num_resident == m.num_blocks  # the load needed all of it
    # Weights, the pool at its capacity, a step's scratch; a growth step's copy fits in the
    # scratch's room or came out of the pool's capacity.
    assert mx.get_peak_memory() - before <= m.weights + budget + m.activations, (mx.get_peak_memory(), before, m)
    kv.pool.check_whole()


def test_idle_pool_is_cut_back_and_still_serves_the_same(tiny_dir):
    rng = seeded_rng()
    batch = prompts(rng, 16, shared=32)
    e = tiny_engine(tiny_dir)
    kv = e.scheduler.kv
    floor = kv.pool.num_resident
    first = e.generate(batch, GREEDY)
    grown = kv.pool.num_resident
    assert grown > floor

    # A request that holds blocks keeps the pool grown, however long it sits.
    e.add_request("held", batch[0], GREEDY)
    e.step()
    assert not kv.release_idle(0.0) and not kv.release_idle(10 * IDLE_RELEASE_S)
    e.abort(["held"])
    e.step()

    t = 1000.0
    assert not kv.release_idle(t)  # idle from now on
    assert not kv.release_idle(t + IDLE_RELEASE_S / 2)
    assert kv.release_idle(t + IDLE_RELEASE_S)
    assert kv.pool.num_resident == floor
    assert_arrays_match_pool(e)
    assert all(b.block_id < floor for b in kv.pool.cached.values())
    kv.pool.check_whole()
    assert not kv.release_idle(t + 2 * IDLE_RELEASE_S)  # nothing left to cut

    assert e.generate(batch, GREEDY) == first  # grows again and serves the same
    assert kv.pool.num_resident > floor


def test_a_draft_models_kv_grows_and_shrinks_with_the_pool(tiny_dir, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=12, max_position_embeddings=4096)
    cfg = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 2}}'
    rng = seeded_rng()
    batch = prompts(rng, 12)
    expected = tiny_engine(tiny_dir).generate(batch, GREEDY)
    e = tiny_engine(tiny_dir, speculative_config=cfg)
    kv = e.scheduler.kv
    floor = kv.pool.num_resident
    assert e.generate(batch, GREEDY) == expected
    assert e.metrics.spec_draft_tokens._value.get() > 0
    assert kv.pool.num_resident > floor
    assert all(a.shape[0] == kv.pool.num_resident for a in e.drafter.arrays())
    assert kv.release_idle(0.0) is False and kv.release_idle(IDLE_RELEASE_S)
    assert all(a.shape[0] == floor for a in e.drafter.arrays())
    assert e.generate(batch[:3], GREEDY) == expected[:3]
