"""Decode steps replayed from compiled traces (engined.fastpath.compiled_decode): a graph is replayed only for a
step that would have built the same one, the K/V pools are written in place as in a built step, shapes
are traced the second time they are met, the traces kept stay bounded, and a trace that fails leaves the
steps built. That outputs equal a built step's, family by family, is in test_families."""

import gc

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engined import kernels
from mlxd.engined.engine import Engine
from mlxd.engined.fastpath import compiled_decode
from mlxd.engined.kernels import AttentionMetadata
from mlxd.engined.kernels.gpu_geometry import PARTITION_TOKENS
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import fresh_seed, make_tiny_model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3") / "qwen3", "qwen3", seed=fresh_seed("qwen3 model"))


def engine_on(path, compile_decode=True, **kw):
    config = dict(num_kv_blocks=256, block_size=8, max_num_seqs=4, attention_backend="reference",
                  compile_decode=compile_decode)
    return Engine(EngineConfig(**(config | kw)), loaded=load_model(str(path)))


def test_replay_key_holds_what_a_step_s_graph_takes_from_the_host():
    decode = AttentionMetadata.build([1, 1], [40, 9], [[3, 4, 5, 6, 7], [8, 9]], 8)
    mixed = AttentionMetadata.build([1, 5], [40, 9], [[3, 4, 5, 6, 7], [8, 9]], 8)
    assert decode.block_tables.shape == (2, 8)  # padded to whole steps of 8 blocks
    assert kernels.replay_key("reference", decode) == ()
    # A chunk's length and position shape its graph; the host path reads its inputs while building.
    assert kernels.replay_key("reference", mixed) is None
    assert kernels.replay_key("host", decode) is None
    # The GPU kernels' launch follows the longest context's partitions: a step whose longest context
    # takes more of them is a different graph.
    long = 3 * PARTITION_TOKENS
    tables = [list(range(long // 8)), [8, 9]]
    longer = AttentionMetadata.build([1, 1], [long, 9], tables, 8)
    for dialect in ("cuda", "metal"):
        assert kernels.replay_key(dialect, decode) == (1, PARTITION_TOKENS)
        assert kernels.replay_key(dialect, longer)[0] == 3
        assert kernels.replay_key(dialect, mixed) is None


def test_a_replayed_step_writes_the_pools_in_place(qwen3):
    peaks = {}
    for on in (False, True):
        engine = engine_on(qwen3, on, num_kv_blocks=8192)
        engine.runner.kv.create(8192)  # every block resident: each layer's K and V pool 2 MB or more
        pool = min(a.nbytes for a in engine.runner.kv.main.arrays())
        assert pool >= 2 << 20
        rng = np.random.default_rng(fresh_seed("prompts"))
        for i in range(3):
            engine.add_request(f"r{i}", rng.integers(0, 256, 20 + i).tolist(),
                               SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        for _ in range(8):
            engine.step()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        for _ in range(6):
            engine.step()
        # A pool written by copy would hold two of itself at once.
        assert mx.get_peak_memory() - base < pool, (mx.get_peak_memory() - base, pool)
        compiled = engine.runner.compiled
        peaks[on] = (mx.get_peak_memory(), compiled and (compiled.traces, compiled.calls))
        del engine
        gc.collect()
    (built_peak, _), (replayed_peak, (traces, calls)) = peaks[False], peaks[True]
    assert calls >= traces + 6
    # Nor does a replayed step keep the pools it was given alive beside the ones it wrote.
    assert replayed_peak - built_peak < pool, (replayed_peak, built_peak, pool)


def test_traces_kept_stay_bounded_and_outputs_stay_right_when_dropped(qwen3, monkeypatch):
    rng = np.random.default_rng(fresh_seed("prompts"))
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 30, 61, 90)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (70, 20, 45, 33)]
    want = engine_on(qwen3, False).generate(prompts, params)
    monkeypatch.setattr(compiled_decode, "MAX_GRAPHS", 2)
    engine = engine_on(qwen3)
    assert engine.generate(prompts, params) == want
    compiled = engine.runner.compiled
    assert compiled.traces > 2 and len(compiled._graphs) == 2


def test_a_step_s_shapes_are_built_the_first_time_and_traced_the_second(qwen3):
    engine = engine_on(qwen3)
    compiled = engine.runner.compiled
    engine.add_request("r", list(range(1, 30)), SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt, one chunk: not a decode step
    seen = []
    for _ in range(70):  # 30 to 100 tokens of context: the table passes 8 blocks (64 tokens) once
        engine.step()
        seen.append((compiled.traces, compiled.calls))
    # Each of the two table widths: built once, traced at its second step, replayed after.
    assert seen[:3] == [(0, 0), (1, 1), (1, 2)], seen[:3]
    widen = next(i for i, (traces, _) in enumerate(seen) if traces == 2)
    assert seen[widen - 2][0] == 1 and seen[widen - 1] == seen[widen - 2], seen[widen - 3 : widen + 2]
    assert seen[-1] == (2, 68)


def test_a_trace_that_fails_turns_replaying_off_and_the_steps_are_built(qwen3, monkeypatch):
    rng = np.random.default_rng(fresh_seed("prompts"))
    prompts = [rng.integers(0, 256, n).tolist() for n in (12, 40)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = engine_on(qwen3, False).generate(prompts, params)

    def untraceable(self, *arrays):  # as an operation a device's compile cannot take would fail
        raise ValueError("not traceable here")

    monkeypatch.setattr(compiled_decode.CompiledDecode, "_forward", untraceable)
    engine = engine_on(qwen3)
    assert engine.generate(prompts, params) == want
    compiled = engine.runner.compiled
    assert compiled.off and compiled.traces == 1 and compiled.calls == 0
