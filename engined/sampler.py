"""Sampling in MLX for a whole step's rows at once.

Greedy rows take the argmax of the processed logits; the others use the
Gumbel-max trick with noise drawn from a key derived from the request's seed
and its output position, so a seeded request reproduces whatever else is in
the batch. Logprobs are of the raw model distribution (before penalties,
bias and temperature), as in vLLM's default.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engined.request import Request
from shared.protocol import Logprob

_NEG = -1e30
_MASK64 = (1 << 64) - 1


def row_key(seed: int, position: int) -> mx.array:
    # A position-dependent seed: splitmix-style mixing keeps nearby seeds apart.
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x ^= x >> 31
    return mx.random.key(x)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], grammars=None):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        # engined.structured.GrammarCompiler: masks rows of constrained requests.
        self.grammars = grammars

    def __call__(self, logits: mx.array, reqs: list[Request]) -> tuple[mx.array, list | None]:
        """Sample one token per row of ``logits [S, V]``; returns (tokens [S], logprob parts or None).

        Nothing is evaluated here: the caller evaluates tokens together with the
        step's KV writes.
        """
        logits = logits.astype(mx.float32)
        logits = logits[:, : self.vocab_size] if logits.shape[1] > self.vocab_size else logits
        lp_parts = self.raw_logprobs(logits, reqs)

        processed = self.process(logits, reqs)
        greedy = np.array([r.params.temperature == 0.0 for r in reqs])
        if greedy.all():
            return mx.argmax(processed, axis=-1), lp_parts
        noise = mx.stack([mx.random.gumbel((logits.shape[1],), key=row_key(r.seed, r.num_output_tokens))
                          for r in reqs])
        sampled = mx.argmax(processed + noise, axis=-1)
        if greedy.any():
            sampled = mx.where(mx.array(greedy), mx.argmax(processed, axis=-1), sampled)
        return sampled, lp_parts

    @staticmethod
    def raw_logprobs(logits: mx.array, reqs: list[Request]):
        """(log-softmax, top-k ids) of the raw logits when any row asks for logprobs, else None."""
        if all(r.params.logprobs is None for r in reqs):
            return None
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        k = max(r.params.logprobs or 0 for r in reqs)
        return lp, (mx.argsort(-lp, axis=-1)[:, :k] if k else None)

    def process(self, logits: mx.array, reqs: list[Request], allowed: mx.array | None = None) -> mx.array:
        """Logits after penalties, bias, min_tokens, then temperature and top-k/top-p/min-p.

        Greedy rows skip the temperature (their argmax is what counts). Rows of
        constrained requests first lose every token their grammar forbids, so
        top-p and friends renormalize over what the grammar allows. Those masks
        come from each grammar's current state unless ``allowed [S, V]`` (bool)
        is given: a speculation window's rows each follow a different draft prefix.
        """
        if allowed is None and self.grammars is not None and any(r.grammar is not None for r in reqs):
            allowed = self.grammars.token_bitmask([r.grammar for r in reqs])
        if allowed is not None:
            logits = mx.where(allowed, logits, _NEG)
        logits = self._penalize(logits, reqs)
        if all(r.params.temperature == 0.0 for r in reqs):
            return logits
        temps = mx.array([r.params.temperature or 1.0 for r in reqs], dtype=mx.float32)[:, None]
        return self._truncate(logits / temps, reqs)

    def _penalize(self, logits: mx.array, reqs: list[Request]) -> mx.array:
        """Repetition/presence/frequency penalties, logit bias and min_tokens, as one dense update."""
        s, v = logits.shape
        needs = [
            (r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
             or r.params.logit_bias or r.num_output_tokens < r.params.min_tokens)
            for r in reqs
        ]
        if not any(needs):
            return logits
        scale = np.ones((s, v), dtype=np.float32)  # repetition: divide positive, multiply negative
        add = np.zeros((s, v), dtype=np.float32)
        for i, r in enumerate(reqs):
            if not needs[i]:
                continue
            p = r.params
            if p.repetition_penalty != 1.0:
                seen = np.unique(np.asarray(r.token_ids, dtype=np.int64))
                scale[i, seen[seen < v]] = p.repetition_penalty
            if p.presence_penalty or p.frequency_penalty:
                counts = np.bincount(np.asarray(r.output_token_ids, dtype=np.int64), minlength=v)[:v]
                add[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if p.logit_bias:
                ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64)
                add[i, ids] += np.fromiter(p.logit_bias.values(), dtype=np.float32)
            if r.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                add[i, [t for t in stops if t < v]] = _NEG
        scale_mx = mx.array(scale)
        logits = mx.where(logits > 0, logits / scale_mx, logits * scale_mx)
        return logits + mx.array(add)

    def _truncate(self, logits: mx.array, reqs: list[Request]) -> mx.array:
        """top_k, top_p and min_p on temperature-scaled logits; masked entries get -inf."""
        top_k = [r.params.top_k if r.params.top_k > 0 else 0 for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        min_p = [r.params.min_p for r in reqs]
        if max(top_k) == 0 and min(top_p) >= 1.0 and max(min_p) == 0.0:
            return logits
        v = logits.shape[1]
        order = mx.argsort(-logits, axis=-1)
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        rank = mx.arange(v)[None, :]
        k = mx.array([t or v for t in top_k])[:, None]
        keep = rank < k
        # Keep a token while the mass before it is below top_p (the first token always stays).
        before = mx.cumsum(probs, axis=-1) - probs
        keep = keep & (before < mx.array(top_p, dtype=mx.float32)[:, None])
        keep = keep & (probs >= mx.array(min_p, dtype=mx.float32)[:, None] * probs[:, :1])
        masked_sorted = mx.where(keep, sorted_logits, _NEG)
        # Scatter back to vocabulary order.
        inverse = mx.argsort(order, axis=-1)
        return mx.take_along_axis(masked_sorted, inverse, axis=-1)


def logprobs_for(lp_parts, tokens: list[int], reqs: list[Request]) -> list[Logprob | None]:
    """Host-side Logprob records after evaluation; None for rows that did not ask."""
    lp, top = lp_parts
    rows = mx.arange(len(tokens))
    chosen = lp[rows, mx.array(tokens)].tolist()
    top_ids = top.tolist() if top is not None else None
    top_lps = mx.take_along_axis(lp, top, axis=-1).tolist() if top is not None else None
    out = []
    for i, r in enumerate(reqs):
        k = r.params.logprobs
        if k is None:
            out.append(None)
        elif k == 0:
            out.append(Logprob(chosen[i]))
        else:
            out.append(Logprob(chosen[i], top_ids[i][:k], top_lps[i][:k]))
    return out
