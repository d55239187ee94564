"""Attention sinks in the paged contract: a per-head logit in the softmax denominator.

The oracle is written out in float64 numpy per request and head, so it shares
no code with the reference (which uses SDPA's ``sinks`` or its own softcap path).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engined import kernels
from mlxd.engined.kernels import paged_kv
from tests.kernels.cases import make_case, rel_error


def dense_with_sinks(case, sinks: np.ndarray, sliding_window=None, softcap=None) -> np.ndarray:
    meta = case.meta
    qf = np.asarray(case.q.astype(mx.float32), dtype=np.float64)
    t, h, _ = qf.shape
    hkv = case.k_dense[0].shape[1]
    out = np.zeros_like(qf)
    for b, (ql, sl) in enumerate(zip(meta.query_lens_np, meta.seq_lens_np)):
        start = int(meta.cu_seqlens_q_np[b])
        k = case.k_dense[b].astype(np.float64)
        v = case.v_dense[b].astype(np.float64)
        for i in range(int(ql)):
            pos = int(sl) - int(ql) + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for head in range(h):
                kh = head // (h // hkv)
                s = k[lo : pos + 1, kh] @ qf[start + i, head] * case.scale
                if softcap is not None:
                    s = np.tanh(s / softcap) * softcap
                m = max(s.max(), sinks[head])
                e = np.exp(s - m)
                out[start + i, head] = e @ v[lo : pos + 1, kh] / (e.sum() + np.exp(sinks[head] - m))
    return out


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (7, None), (None, 5.0), (9, 5.0)])
def test_sinks_mixed_batch_match_explicit_softmax(rng, sliding_window, softcap):
    # Decode rows, a prefill chunk after cached context and a fresh prefill, shuffled blocks.
    case = make_case(rng, [1, 13, 1, 6], [30, 40, 5, 6], 8, 2, 16, 8)
    sinks = rng.standard_normal(8) * 2
    out = kernels.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                  sliding_window=sliding_window, softcap=softcap, sinks=mx.array(sinks, dtype=mx.float32))
    ref = dense_with_sinks(case, sinks, sliding_window, softcap)
    assert rel_error(out, mx.array(ref.astype(np.float32))) < 2e-5


def test_sinks_change_the_answer_and_none_keeps_the_old_contract(rng):
    case = make_case(rng, [1, 9], [20, 9], 4, 4, 16, 8)
    plain = paged_kv.reference_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    zeros = np.full(4, -np.inf)  # a sink at -inf takes no mass: same as no sink
    assert rel_error(plain, mx.array(dense_with_sinks(case, zeros).astype(np.float32))) < 2e-5
    heavy = paged_kv.reference_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                      sinks=mx.full((4,), 3.0))
    assert rel_error(heavy, plain) > 1e-2
