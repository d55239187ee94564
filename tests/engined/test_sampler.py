"""The sampler's truncation and penalties against a plain numpy oracle (full sorts, dense arrays)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engined.request import Request
from mlxd.engined.sampler import _CANDIDATES, _NEG, Sampler
from mlxd.shared.protocol import SamplingParams


def _request(i: int, params: SamplingParams, prompt: list[int], output: list[int]) -> Request:
    req = Request(f"r{i}", prompt, params, seed=i)
    req.token_ids += output
    return req


def _oracle_truncate(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The kept set by definition: sort the whole row, keep the prefix the three rules allow."""
    order = np.argsort(-logits, kind="stable")
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep = np.ones(len(logits), bool)
    if top_k > 0:
        keep &= np.arange(len(logits)) < top_k
    if top_p < 1.0:  # 1: no limit, whatever the float sums reach
        keep &= before < top_p
    keep &= probs >= min_p * probs[0]
    kept = np.zeros(len(logits), bool)
    kept[order[keep]] = True
    return kept


@pytest.mark.parametrize("flat", [False, True], ids=["peaked", "flat"])
def test_truncation_keeps_exactly_the_tokens_topk_topp_minp_allow(flat):
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    vocab = 3 * _CANDIDATES + 17
    # Peaked rows settle within the candidates; flat rows (random-weight models) run past them.
    scale = 0.05 if flat else 4.0
    logits = (rng.standard_normal((12, vocab)) * scale).astype(np.float32)
    settings = [(int(rng.choice([0, 1, 5, 50, 2000])), float(rng.choice([1.0, 0.95, 0.5, 0.1])),
                 float(rng.choice([0.0, 0.05, 0.5]))) for _ in range(12)]
    reqs = [_request(i, SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=m), [1], [])
            for i, (k, p, m) in enumerate(settings)]
    got = np.array(Sampler(vocab, [0])._truncate(mx.array(logits), reqs)) > _NEG / 2
    for i, (k, p, m) in enumerate(settings):
        want = _oracle_truncate(logits[i], k, p, m)
        assert (got[i] == want).all(), (i, k, p, m, int(got[i].sum()), int(want.sum()))


def test_penalties_bias_and_min_tokens_match_the_dense_definition():
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    vocab, rows = 300, 6
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    reqs, want = [], logits.copy()
    for i in range(rows):
        prompt = rng.integers(0, vocab, 20).tolist()
        output = rng.integers(0, vocab, 15).tolist()
        params = SamplingParams(
            repetition_penalty=float(rng.choice([1.0, 1.3])), presence_penalty=float(rng.choice([0.0, 0.7])),
            frequency_penalty=float(rng.choice([0.0, 0.4])), min_tokens=int(rng.choice([0, 100])),
            logit_bias={int(t): float(rng.normal()) for t in rng.integers(0, vocab, 3)},
            stop_token_ids=[7, 9],
        )
        reqs.append(_request(i, params, prompt, output))
        row = want[i]
        if params.repetition_penalty != 1.0:
            seen = np.unique(prompt + output)
            row[seen] = np.where(row[seen] > 0, row[seen] / params.repetition_penalty,
                                 row[seen] * params.repetition_penalty)
        counts = np.bincount(output, minlength=vocab)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        for t, b in params.logit_bias.items():
            row[t] += b
        if len(output) < params.min_tokens:
            row[[0, 7, 9]] = _NEG
    got = np.array(Sampler(vocab, [0])._penalize(mx.array(logits), reqs))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("flat", [False, True], ids=["head", "whole-vocabulary"])
def test_sampled_tokens_follow_the_truncated_distribution(flat):
    """Thousands of seeds over one row: Pearson's chi-square against softmax over the kept set.

    The statistic of ``df`` degrees of freedom has mean ``df`` and deviation
    ``sqrt(2 df)``; 6 deviations above the mean is a false alarm well under
    once in a million runs, while a sampler off the distribution lands far
    past it.
    """
    seed = random.randrange(2**32)
    print("seed", seed)
    _check_distribution(seed, flat)


def _check_distribution(seed: int, flat: bool) -> None:
    rng = np.random.default_rng(seed)
    vocab, n = 2 * _CANDIDATES + 5, 3000
    row = (rng.standard_normal(vocab) * (0.01 if flat else 3.0)).astype(np.float32)
    if not flat:
        # A peaked draw can give one token over 0.9 of the mass, which leaves no
        # degree of freedom to test: its 8 largest logits are moved within one
        # logit of the top, so the kept set always holds several tokens.
        head = np.argsort(row)[-8:]
        row[head] = row.max() - rng.uniform(0.0, 1.0, 8).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_p=0.999 if flat else 0.9, top_k=0 if flat else 40)
    reqs = [Request(f"r{i}", [1], params, seed=int(rng.integers(2**62))) for i in range(n)]
    tokens, _ = Sampler(vocab, [0])(mx.array(np.tile(row, (n, 1))), reqs)
    tokens = np.array(tokens)
    scaled = row / params.temperature
    kept = _oracle_truncate(scaled, params.top_k, params.top_p, 0.0)
    assert kept[tokens].all()
    probs = np.exp(scaled[kept] - scaled[kept].max())
    expected = n * probs / probs.sum()
    observed = np.bincount(tokens, minlength=vocab)[kept]
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    assert df >= 1, df
    assert chi2 < df + 6 * np.sqrt(2 * df), (chi2, df)


def test_greedy_rows_beside_sampled_rows_take_the_argmax():
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    vocab = 2 * _CANDIDATES
    logits = (rng.standard_normal((4, vocab)) * 3).astype(np.float32)
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=0.0 if i % 2 else 0.7, top_p=0.9), seed=i)
            for i in range(4)]
    tokens = np.array(Sampler(vocab, [0])(mx.array(logits), reqs)[0])
    assert tokens[1] == logits[1].argmax() and tokens[3] == logits[3].argmax()


def test_a_step_mixing_peaked_flat_and_untruncated_rows_samples_each_within_its_kept_set():
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    vocab, rows = 2 * _CANDIDATES + 3, 24
    scales = [3.0, 0.01, 1.0] * (rows // 3)
    logits = np.stack([rng.standard_normal(vocab) * s for s in scales]).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.99),
              SamplingParams(temperature=1.0)] * (rows // 3)
    reqs = [Request(f"r{i}", [1], p, seed=i) for i, p in enumerate(params)]
    tokens = np.array(Sampler(vocab, [0])(mx.array(logits), reqs)[0])
    for i, p in enumerate(params):
        assert _oracle_truncate(logits[i], p.top_k, p.top_p, p.min_p)[tokens[i]], i


def test_choosing_overflowing_rows_on_the_device_gives_the_host_checks_tokens():
    """Asynchronous scheduling samples without reading which rows' kept sets overflow their head:
    every row (peaked, flat, untruncated, greedy) gets the token the host-checked path gives it."""
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    vocab, rows = 2 * _CANDIDATES + 3, 24
    scales = [3.0, 0.01, 1.0, 2.0] * (rows // 4)
    logits = mx.array(np.stack([rng.standard_normal(vocab) * s for s in scales]).astype(np.float32))
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50), SamplingParams(temperature=0.8, top_p=0.99),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.0, top_p=0.9)] * (rows // 4)
    reqs = [Request(f"r{i}", [1], p, seed=int(rng.integers(1 << 30))) for i, p in enumerate(params)]
    host, device = Sampler(vocab, [0]), Sampler(vocab, [0], choose_on_device=True)
    _, past = host._sample_head(logits, reqs)
    assert set(range(1, rows, 4)) <= set(past), "the flat top-p rows were meant to overflow their head"
    assert np.array(device(logits, reqs)[0]).tolist() == np.array(host(logits, reqs)[0]).tolist()
