"""Hybrid models (gated delta nets + full attention): state slots, prefix snapshots, memory bounds.

Tiny random-weight qwen3_next / qwen3_5 / qwen3_5_moe models from mlx_lm's own classes.
Logits of the packed step must equal mlx_lm's forward after chunked prefills
that cross block boundaries mid-chunk, and after a request resumes from a
cached prefix (state restored from its snapshot); the state pool is fixed,
holds at most max_num_seqs live states, and frees them when requests end.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gated_delta as mlx_lm_gated_delta

from mlxd.engined.engine import Engine
from mlxd.engined.linear_attention import SlottedLinearAttention
from mlxd.engined.kv.recurrent_state import RecurrentStateGroup
from mlxd.engined.loaders import load_model
from mlxd.engined.request import Request
from mlxd.engined.scheduler import SchedulerOutput
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from mlxd.engined.kernels import gated_delta
from tests.tiny_models import make_tiny_model, seeded_rng

REL_TOL = 2e-4
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def hybrid(request, tmp_path_factory):
    seed = np.random.randint(1 << 30)
    print(f"{request.param}: model seed {seed}")
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=seed)
    return path, load_model(str(path)).model


def drive(engine, steps):
    """Run explicit steps through the runner as the engine would; logits of the last step's last rows."""
    kv = engine.scheduler.kv
    logits = None
    for batch in steps:
        for req, n in batch:
            assert kv.allocate(req, n)
        logits = engine.runner.run(SchedulerOutput(batch), [1] * len(batch))
        mx.eval(logits, kv.arrays())
        for req, n in batch:
            req.num_computed_tokens += n
            kv.commit(req)
    return logits


def state_group(engine) -> RecurrentStateGroup:
    (group,) = [g for g in engine.scheduler.kv.groups if isinstance(g, RecurrentStateGroup)]
    return group


def assert_close(row, reference, tokens):
    ref = reference(mx.array(tokens)[None])[0, -1]
    err = mx.abs(row - ref).max().item()
    assert err <= REL_TOL * mx.abs(ref).max().item(), f"max error {err:.3g}"


def test_chunked_prefill_across_blocks_then_resume_from_cached_prefix(hybrid):
    path, reference = hybrid
    engine = Engine(EngineConfig(num_kv_blocks=64, block_size=8), loaded=load_model(str(path)))
    rng = seeded_rng()
    prompt = rng.integers(0, 256, size=37).tolist()
    a = Request("a", prompt, GREEDY, 0)
    # Chunks of 10, 10, 10, 7: every chunk crosses a block boundary in its middle; a decode row
    # from another request shares the steps.
    d = Request("d", rng.integers(0, 256, size=10).tolist(), GREEDY, 0)
    logits = drive(engine, [[(a, 10), (d, 8)], [(a, 10), (d, 1)], [(a, 10)], [(a, 7)]])
    assert_close(logits[0], reference, prompt)
    engine.scheduler.kv.free(a)  # a finishes; its blocks and state snapshots stay cached

    # b shares a's first 35 tokens: its cached prefix is cut to the last block with a snapshot
    # (a's longest reusable prefix, 32 tokens), and it resumes from a copy of that state.
    b_tokens = prompt[:35] + rng.integers(0, 256, size=6).tolist()
    b = Request("b", b_tokens, GREEDY, 0)
    prefix = engine.scheduler.kv.cached_prefix(b)
    assert len(prefix) * 8 == 32
    assert engine.scheduler.kv.allocate(b, len(b_tokens) - 32, prefix)
    b.num_computed_tokens = 32
    c = Request("c", rng.integers(0, 256, size=5).tolist(), GREEDY, 0)  # fresh, in the same step
    logits = drive(engine, [[(b, len(b_tokens) - 32), (c, 5), (d, 1)]])
    assert_close(logits[0], reference, b_tokens)
    assert_close(logits[1], reference, c.token_ids)
    assert_close(logits[2], reference, d.token_ids[:10])


def test_a_substituted_recurrence_runs_in_every_linear_layer_and_is_put_back(hybrid):
    """The hook a CUDA GPU's kernel enters by (``engined.kernels.gated_delta.recurrence``): every linear layer of
    every group of a step runs the engine's update, mlx_lm's own name is restored after each layer, and
    the logits are the reference's."""
    path, reference = hybrid
    engine = Engine(EngineConfig(num_kv_blocks=64, block_size=8), loaded=load_model(str(path)))
    layers = [m for m in engine.runner.model.modules() if isinstance(m, SlottedLinearAttention)]
    assert layers and all(layer.recurrence is None for layer in layers)  # the CPU runs mlx_lm's own
    calls = []

    def recording(*args, **kwargs):
        calls.append(args[0].shape[:2])
        return mlx_lm_gated_delta.gated_delta_update(*args, **kwargs)

    for layer in layers:
        layer.recurrence = recording
    rng = seeded_rng()
    prompt = rng.integers(0, 256, size=19).tolist()
    a, d = Request("a", prompt, GREEDY, 0), Request("d", rng.integers(0, 256, size=6).tolist(), GREEDY, 0)
    logits = drive(engine, [[(d, 6)], [(a, 19), (d, 1)]])
    assert_close(logits[0], reference, prompt)
    # Every token of both steps (d's prompt; a's prompt beside d's decode row) went through every layer's
    # update, in groups cut where the plan keeps snapshots.
    assert sum(b * t for b, t in calls) == (6 + 19 + 1) * len(layers)
    assert len(calls) >= 3 * len(layers)
    for layer in layers:
        assert type(layer.inner).__call__.__globals__["gated_delta_update"] is mlx_lm_gated_delta.gated_delta_update


@pytest.mark.parametrize("lower_bound, neg", [(None, False), (None, True), (-5.0, False)])
def test_the_kernel_s_update_gates_as_mlx_lm_s(lower_bound, neg):
    """``engined.kernels.gated_delta.update`` computes the gates as mlx_lm does; here both run mlx_lm's loop (the
    kernel itself needs a CUDA GPU: ``bench/kernels/gated_delta_check.py`` compares it there)."""
    rng = seeded_rng()
    b, t, hk, hv, dk, dv = 2, 5, 2, 4, 32, 16
    arr = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    args = (arr(b, t, hk, dk) * 0.2, arr(b, t, hk, dk) * 0.2, arr(b, t, hv, dv), arr(b, t, hv), arr(b, t, hv),
            arr(hv), arr(hv), arr(b, hv, dv, dk))
    mask = mx.array(rng.random((b, t)) < 0.8)
    kw = dict(use_kernel=False, lower_bound=lower_bound, allow_neg_eigval=neg)
    ours = gated_delta.update(*args, mask, **kw)
    theirs = mlx_lm_gated_delta.gated_delta_update(*args, mask, **kw)
    for x, y in zip(ours, theirs):
        assert mx.array_equal(x, y)
    assert gated_delta.recurrence("cuda") is gated_delta.update
    assert all(gated_delta.recurrence(b) is None for b in ("metal", "host", "reference"))


def test_without_a_snapshot_a_cached_prefix_is_not_used(hybrid):
    path, _ = hybrid
    engine = Engine(EngineConfig(num_kv_blocks=64, block_size=8), loaded=load_model(str(path)))
    prompt = list(range(40))
    a = Request("a", prompt, GREEDY, 0)
    drive(engine, [[(a, 40)]])
    # The KV blocks of all 5 blocks are cached, but states were kept only at 32 and 40 (the
    # prompt's reusable end and the step's last boundary).
    assert engine.scheduler.kv.cached_prefix(Request("x", prompt[:30] + [1, 2], GREEDY, 0)) == []
    assert len(engine.scheduler.kv.cached_prefix(Request("y", prompt[:33] + [1], GREEDY, 0))) == 4


def test_outputs_equal_with_prefix_caching_on_and_off_over_multi_turn(hybrid):
    path, _ = hybrid
    rng = seeded_rng()
    system = rng.integers(0, 256, size=21).tolist()
    follow_ups = [rng.integers(0, 256, size=4).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        engine = Engine(EngineConfig(num_kv_blocks=128, block_size=8, max_num_batched_tokens=16,
                                     enable_prefix_caching=caching), loaded=load_model(str(path)))
        turn = system + [5, 6, 7]
        outs = []
        for message in follow_ups:  # each prompt is the last one, its answer and a new message
            (out,) = engine.generate([turn], params)
            outs.append(out)
            turn = turn + out + message
        results[caching] = (outs, engine.stats().prefix_cache_hits)
    assert results[True][0] == results[False][0]
    assert results[True][1] >= 2 * 24  # later turns resume from snapshots past the system prompt


def test_state_pool_bounded_under_64_concurrent_requests_and_freed(hybrid):
    path, _ = hybrid
    config = EngineConfig(num_kv_blocks=512, block_size=8, max_num_seqs=64, max_num_batched_tokens=2048)
    engine = Engine(config, loaded=load_model(str(path)))
    states = state_group(engine)
    pool_bytes = sum(a.nbytes for a in states.arrays())
    assert pool_bytes == states.nbytes == engine.memory.fixed_bytes
    assert states.nbytes == (64 + 64) * states.bytes_per_slot  # live slots + prefix snapshots

    rng = seeded_rng()
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(3, 30, size=80)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outputs = {f"r{i}": [] for i in range(80)}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        peak = max(peak, len(states.live))
        assert len(states.live) + len(states.free_live) == 64
        assert sum(a.nbytes for a in states.arrays()) == pool_bytes
    assert peak == 64
    assert states.live == {} and sorted(states.free_live) == list(range(64))
    assert len(states.snapshots) + len(states.free_snapshots) == 64 and not states.pending

    # A slot reused by a later request starts from zero: the same answers one at a time.
    alone = Engine(EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=2, enable_prefix_caching=False),
                   loaded=load_model(str(path)))
    for i in rng.choice(80, size=6, replace=False):
        assert alone.generate([prompts[i]], params)[0] == outputs[f"r{i}"]


def test_preempted_hybrid_request_recomputes_its_state(hybrid):
    path, _ = hybrid
    rng = seeded_rng()
    prompts = [rng.integers(0, 256, size=20).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    roomy = Engine(EngineConfig(num_kv_blocks=64, block_size=8), loaded=load_model(str(path)))
    tight = Engine(EngineConfig(num_kv_blocks=12, block_size=8, max_model_len=64), loaded=load_model(str(path)))
    assert tight.generate(prompts, params) == roomy.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert state_group(tight).live == {}


def test_dense_models_get_no_state_pool(tmp_path):
    engine = Engine(EngineConfig(num_kv_blocks=16, block_size=8),
                    loaded=load_model(str(make_tiny_model(tmp_path / "llama", "llama"))))
    assert not any(isinstance(g, RecurrentStateGroup) for g in engine.scheduler.kv.groups)
    assert engine.memory.fixed_bytes == 0
