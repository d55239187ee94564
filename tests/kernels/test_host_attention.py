"""The host path (`paged_kv.host_attention`, numpy: the CPU's attention) against the dense oracle and the pure-MLX
reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engined.kernels import paged_kv
from tests.kernels.cases import dense_attention, make_case, rel_error


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def _batch(rng, max_ctx):
    """Decode rows, a chunk longer than a query block after cached context, a fresh chunk, interleaved."""
    qlens = [1, 1, 1, paged_kv.QUERY_BLOCK + int(rng.integers(1, 60)), int(rng.integers(2, 40)), 1]
    slens = [int(rng.integers(1, max_ctx)), 1, max_ctx, qlens[3] + int(rng.integers(0, max_ctx - qlens[3])),
             qlens[4], int(rng.integers(1, max_ctx))]
    order = rng.permutation(len(qlens))
    return [qlens[i] for i in order], [slens[i] for i in order]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_attention_host_mixed_batch_matches_dense(rng, num_heads, num_kv_heads, block_size):
    qlens, slens = _batch(rng, 700)
    case = make_case(rng, qlens, slens, num_heads, num_kv_heads, 64, block_size)
    out = paged_kv.host_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == case.q.shape and out.dtype == mx.float32
    assert rel_error(out, dense_attention(case)) < 2e-5


@pytest.mark.parametrize("window", [1, 7, 100])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attention_host_window_and_softcap_match_dense(rng, window, softcap):
    qlens, slens = _batch(rng, 500)
    case = make_case(rng, qlens, slens, 8, 2, 64, 16)
    out = paged_kv.host_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                               sliding_window=window, softcap=softcap)
    assert rel_error(out, dense_attention(case, sliding_window=window, softcap=softcap)) < 2e-5


@pytest.mark.parametrize("window", [None, 64])
def test_attention_host_sinks_match_reference(rng, window):
    qlens, slens = _batch(rng, 400)
    case = make_case(rng, qlens, slens, 8, 2, 64, 16)
    sinks = mx.array(rng.normal(size=8).astype(np.float32) * 3)
    args = (case.q, case.k_cache, case.v_cache, case.meta, case.scale, window, None, sinks)
    ours, ref = paged_kv.host_attention(*args), paged_kv.reference_attention(*args)
    assert rel_error(ours, ref) < 2e-5
    # The sinks must matter: without them the answer moves.
    plain = paged_kv.host_attention(*args[:-1])
    assert rel_error(plain, ref) > 1e-3


def test_attention_host_long_context_up_to_8k(rng):
    case = make_case(rng, [1, 1, 300], [8192, 4000, 8000], 8, 2, 128, 16)
    out = paged_kv.host_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert rel_error(out, dense_attention(case)) < 2e-5
    assert paged_kv.host_supported(case.q, case.k_cache)
    assert not paged_kv.host_supported(case.q.astype(mx.float16), case.k_cache.astype(mx.float16))
