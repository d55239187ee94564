"""Speculative decoding: draft proposals and their verification inside the packed step.

A speculating request contributes ``1 + k`` query rows to the step (its last
token plus ``k`` draft tokens); the target model scores them all in the same
forward as everyone else's rows. Verification keeps the target distribution
exactly: at temperature 0 a draft token is kept iff it is the target's argmax;
otherwise by rejection sampling (keep ``d`` with probability
``min(1, p(d)/q(d))``, else sample the normalized residual ``max(p - q, 0)``).
An n-gram draft is deterministic, so its ``q`` is one-hot. Rejected tokens'
K/V stay in slots past the request's computed length and are overwritten when
those positions are computed again.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engined.request import Request
from engined.sampler import Sampler, row_key

_NEG = -1e30


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def can_speculate(req: Request) -> bool:
    """History-dependent logits processors would need re-running per draft position: those requests decode plainly.

    So do constrained requests: their mask depends on every earlier token.
    """
    p = req.params
    return (
        p.speculate
        and req.grammar is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and req.num_output_tokens >= p.min_tokens
    )


class Verifier:
    """Accepts or rejects every draft of a step at once; one MLX graph for all speculating rows."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: mx.array, reqs: list[Request], drafts: list[list[int]],
                 draft_probs: mx.array | None = None):
        """``logits [sum(1 + k_i), V]`` rows in request order; returns (accept [R], alt [R]) arrays.

        Row ``j`` of request ``i`` decides draft ``drafts[i][j]`` (``accept``) and
        holds the token to emit if it is the first rejected one, or the bonus
        token after the last draft (``alt``). ``draft_probs`` (same rows; the
        bonus rows ignored) is the draft model's distribution; None for one-hot
        (n-gram) drafts.
        """
        rows_req = [r for r, d in zip(reqs, drafts) for _ in range(len(d) + 1)]
        pos = [r.num_output_tokens + j for r, d in zip(reqs, drafts) for j in range(len(d) + 1)]
        draft_tok = np.array([t for d in drafts for t in list(d) + [0]], dtype=np.int32)
        is_bonus = np.array([j == len(d) for d in drafts for j in range(len(d) + 1)])
        logits = logits.astype(mx.float32)[:, : self.sampler.vocab_size]
        processed = self.sampler.process(logits, rows_req)
        greedy = np.array([r.params.temperature == 0.0 for r in rows_req])
        d = mx.array(draft_tok)
        argmax = mx.argmax(processed, axis=-1)
        if greedy.all():
            return argmax == d, argmax
        probs = mx.softmax(processed, axis=-1)
        p_d = mx.take_along_axis(probs, d[:, None], axis=-1)[:, 0]
        keys = [row_key(r.seed, j) for r, j in zip(rows_req, pos)]
        u = mx.stack([mx.random.uniform(shape=(), key=mx.random.split(k)[0]) for k in keys])
        vocab = mx.arange(probs.shape[1])[None, :]
        if draft_probs is None:
            accept = u < p_d
            residual = mx.where(vocab == d[:, None], 0.0, probs)
        else:
            q_d = mx.take_along_axis(draft_probs, d[:, None], axis=-1)[:, 0]
            accept = u * q_d < p_d
            residual = mx.maximum(probs - draft_probs, 0.0)
        # The bonus row samples the plain target distribution.
        residual = mx.where(mx.array(is_bonus)[:, None], probs, residual)
        noise = mx.stack([mx.random.gumbel((probs.shape[1],), key=k) for k in keys])
        alt = mx.argmax(mx.log(residual + 1e-30) + mx.where(residual > 0, noise, _NEG), axis=-1)
        g = mx.array(greedy)
        return mx.where(g, argmax == d, accept), mx.where(g, argmax, alt)


# Keeps the draft's sampling noise independent of the verifier's for the same seed and position.
_DRAFT_SEED_OFFSET = 0x5DEECE66D


class DraftProposer:
    """A smaller model of the same vocabulary drafts ``k`` tokens per request, one pass per token.

    Its paged KV lives in its own per-layer arrays indexed by the target's block
    ids, so one block allocation covers both models (the memory guard bills a
    block for both). ``req.draft_computed`` counts the tokens whose draft K/V is
    written; the first pass of a step catches up from there.
    """

    def __init__(self, runner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler

    def propose(self, reqs: list[Request], tables: list[list[int]]) -> mx.array:
        """Fill each request's ``spec_tokens`` (already sized) with drafts; returns their distributions.

        The result has the verifier's row layout: per request ``k`` rows of the
        draft's distribution and one zero row for the bonus position.
        """
        ks = [len(r.spec_tokens) for r in reqs]
        pieces = [r.token_ids[r.draft_computed :] for r in reqs]
        offsets = [r.draft_computed for r in reqs]
        rows: list[list[mx.array]] = [[] for _ in reqs]
        vocab = self.sampler.vocab_size
        for j in range(max(ks)):
            active = [i for i, k in enumerate(ks) if k > j]
            logits = self.runner.forward(
                [pieces[i] for i in active], [offsets[i] for i in active], [tables[i] for i in active],
                [1] * len(active),
            )
            areqs = [reqs[i] for i in active]
            processed = self.sampler.process(logits.astype(mx.float32)[:, :vocab], areqs)
            probs = mx.softmax(processed, axis=-1)
            noise = mx.stack([
                mx.random.gumbel((vocab,), key=row_key(r.seed + _DRAFT_SEED_OFFSET, r.num_output_tokens + j))
                for r in areqs
            ])
            greedy = mx.array([r.params.temperature == 0.0 for r in areqs])
            tokens = mx.where(greedy, mx.argmax(processed, axis=-1), mx.argmax(processed + noise, axis=-1))
            mx.eval(tokens, probs, self.runner.caches())
            for row, (i, tok) in enumerate(zip(active, tokens.tolist())):
                reqs[i].spec_tokens[j] = tok
                rows[i].append(probs[row])
                offsets[i] += len(pieces[i])
                pieces[i] = [tok]
        zero = mx.zeros((vocab,), dtype=mx.float32)
        for req, off in zip(reqs, offsets):
            req.draft_computed = off
        return mx.stack([row for per_req in rows for row in per_req + [zero]])
