"""Speculative decoding: draft proposals and their verification inside the packed step.

The step calls one collaborator, ``Speculator``: ``propose`` (before
scheduling: n-gram drafts, or room for the draft model of ``draft_model`` or
the MTP layer of ``mtp``), ``draft`` (after scheduling: the drafter fills what
fits the budget) and ``verify`` (after the forward). Drafts travel in the
scheduler's output, never on the request.

A speculating request contributes ``1 + k`` query rows to the step (its last
token plus ``k`` draft tokens); the target model scores them all in the same
forward as everyone else's rows. Verification keeps the target distribution
exactly: at temperature 0 a draft token is kept iff it is the target's argmax;
otherwise by rejection sampling (keep ``d`` with probability
``min(1, p(d)/q(d))``, else sample the normalized residual ``max(p - q, 0)``).
An n-gram draft is deterministic, so its ``q`` is one-hot. Rejected tokens'
K/V stay in slots past the request's computed length and are overwritten when
those positions are computed again.

A constrained request speculates too: its grammar is walked along the draft
(``DraftWalk``), which cuts an n-gram draft at the first token the grammar
rejects and masks each step of a draft model, and gives every window row its
own mask. Target and draft distributions are both masked by it, so the
verified tokens are what constrained plain decoding would have produced.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mlxd.engined.request import Request
from mlxd.engined.sampler import Sampler, logprobs_for, row_key
from mlxd.shared.config import SpeculativeConfig

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

    Grammars are history-dependent too, but their masks per draft position are
    computed by walking the matcher (``Grammar.check_draft``, ``DraftWalk``).
    """
    return may_speculate(req.params) and req.num_output_tokens >= req.params.min_tokens


def may_speculate(p) -> bool:
    """Whether a request of these sampling parameters ever speculates (``can_speculate`` less min_tokens)."""
    return p.speculate and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty


class Verifier:
    """Accepts or rejects every draft of a step at once; one MLX graph for all speculating rows."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: mx.array, reqs: list[Request], drafts: list[list[int]],
                 draft_probs: mx.array | None = None, allowed: mx.array | None = None):
        """``logits [sum(1 + k_i), V]`` rows in request order; returns (accept [R], alt [R]) arrays.

        Row ``j`` of request ``i`` decides draft ``drafts[i][j]`` (``accept``) and
        holds the token to emit if it is the first rejected one, or the bonus
        token after the last draft (``alt``). ``draft_probs`` (same rows; the
        bonus rows ignored) is the draft model's distribution; None for one-hot
        (n-gram) drafts. ``allowed [sum(1 + k_i), V]`` (bool) is each row's
        grammar mask, needed when any request is constrained.
        """
        rows_req = [r for r, d in zip(reqs, drafts) for _ in range(len(d) + 1)]
        pos = [r.num_output_tokens + j for r, d in zip(reqs, drafts) for j in range(len(d) + 1)]
        draft_tok = np.array([t for d in drafts for t in list(d) + [0]], dtype=np.int32)
        is_bonus = np.array([j == len(d) for d in drafts for j in range(len(d) + 1)])
        logits = logits.astype(mx.float32)[:, : self.sampler.vocab_size]
        processed = self.sampler.process(logits, rows_req, allowed)
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


class Speculator:
    """The step's one speculation collaborator: propose before scheduling, draft after it, verify after the forward.

    The engine makes one only when speculation is on; without it the step runs plainly.
    """

    def __init__(self, config: SpeculativeConfig, sampler: Sampler, metrics, max_model_len: int,
                 drafter=None, tables=None):
        self.config = config
        self.sampler = sampler
        self.verifier = Verifier(sampler)
        self.metrics = metrics
        self.max_model_len = max_model_len
        # draft_model.DraftProposer or mtp.MTPProposer (of this package), and the target's block tables
        # by request id the draft model writes through.
        self.drafter = drafter
        self.mtp = config is not None and config.method == "mtp"
        self.tables = tables
        self._draft_probs: mx.array | None = None
        # This step's window masks (packed) of constrained requests with drafts.
        self._bits: dict[Request, np.ndarray] = {}
        # Requests whose proposal raised since the last ``take_failures``, with the exception.
        self._failures: list[tuple[Request, Exception]] = []

    def take_failures(self) -> list[tuple[Request, Exception]]:
        failures, self._failures = self._failures, []
        return failures

    def propose(self, running: list[Request]) -> dict[Request, list[int]]:
        """Draft tokens (n-gram) or reserved room (draft model) for requests that are decoding and may speculate.

        A request whose proposal raises gets no draft and waits in ``take_failures`` for the engine to fail it.
        """
        cfg = self.config
        self._bits = {}
        if self.drafter:
            self.drafter.retain(r.request_id for r in running)
        drafts = {}
        for req in running:
            room = min(cfg.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1,
                       self.max_model_len - req.num_tokens - 1)
            if room <= 0 or req.num_computed_tokens != req.num_tokens - 1 or not can_speculate(req):
                continue
            if self.drafter:
                # Room reserved now; the draft model fills it once the step is scheduled.
                drafts[req] = [0] * room
                continue
            try:
                draft = self._ngram_draft(req, room)
            except Exception as e:  # this request's history or matcher broke: it alone fails
                self._bits.pop(req, None)
                self._failures.append((req, e))
                continue
            if draft:
                drafts[req] = draft
        return drafts

    def _ngram_draft(self, req: Request, room: int) -> list[int]:
        cfg = self.config
        draft = ngram_propose(np.asarray(req.token_ids), room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if req.grammar is not None and draft:
            # Cut before scheduling, so the budget is spent on tokens that can be accepted.
            bits = self.sampler.grammars.new_bits(len(draft) + 1)
            del draft[req.grammar.check_draft(draft, bits) :]
            if draft:
                self._bits[req] = bits
        return draft

    def draft(self, batch) -> None:
        """After scheduling: the draft model fills the drafts that survived the budget (``batch.drafts``)."""
        self._draft_probs = None
        if not self.drafter:
            return
        # A preempted request (perhaps readmitted in the same schedule, into other blocks) drafts anew.
        self.drafter.forget(r.request_id for r in batch.preempted)
        drafting = [r for r, _ in batch.scheduled if r in batch.drafts]
        if self.mtp:  # every step: the MTP layer reads the target's hidden states of each forward
            self._draft_probs, self._bits = self.drafter.propose(batch, drafting, [batch.drafts[r] for r in drafting])
        elif drafting:
            self._draft_probs, self._bits = self.drafter.propose(
                drafting, [batch.drafts[r] for r in drafting], [self.tables(r.request_id) for r in drafting])

    def verify(self, logits: mx.array, spec: list[tuple[Request, int]], batch_drafts: dict[Request, list[int]]):
        """Verification graphs for requests with drafts (``(request, first logits row)``).

        Returns (arrays to evaluate with the step, a function that after
        evaluation gives {request: (new tokens, Logprob records or Nones)}).
        """
        reqs = [r for r, _ in spec]
        drafts = [list(batch_drafts[r]) for r in reqs]
        rows_req = [r for r, d in zip(reqs, drafts) for _ in range(len(d) + 1)]
        idx = np.concatenate([np.arange(o, o + len(d) + 1) for (_, o), d in zip(spec, drafts)])
        rows = logits[mx.array(idx.astype(np.int32))]
        accept, alt = self.verifier(rows, reqs, drafts, self._draft_probs, self._window_masks(reqs, drafts))
        lp = self.sampler.raw_logprobs(rows, rows_req)

        def results():
            acc, alts, start = accept.tolist(), alt.tolist(), 0
            row_tokens, accepted = [], []
            for d in drafts:
                n_acc = next((j for j in range(len(d)) if not acc[start + j]), len(d))
                accepted.append(n_acc)
                # Rows past the first rejection emit nothing; they are padded to keep the layout.
                row_tokens += d[:n_acc] + [alts[start + n_acc]] + [0] * (len(d) - n_acc)
                start += len(d) + 1
            lps = logprobs_for(lp, row_tokens, rows_req) if lp else [None] * len(rows_req)
            out, start = {}, 0
            for req, d, n_acc in zip(reqs, drafts, accepted):
                out[req] = (row_tokens[start : start + n_acc + 1], lps[start : start + n_acc + 1])
                start += len(d) + 1
            self.metrics.on_spec([len(d) for d in drafts], accepted)
            return out

        return [accept, alt, lp or []], results

    def _window_masks(self, reqs: list[Request], drafts: list[list[int]]) -> mx.array | None:
        """Allowed tokens of every window row (the scheduler may have cut drafts short), or None if unconstrained."""
        if all(r.grammar is None for r in reqs):
            return None
        grammars = self.sampler.grammars
        return grammars.to_mask(np.concatenate([
            self._bits[r][: len(d) + 1] if r.grammar is not None else grammars.new_bits(len(d) + 1)
            for r, d in zip(reqs, drafts)
        ]))
