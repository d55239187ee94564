"""Sampling in MLX for a whole step's rows at once.

Greedy rows take the argmax of the processed logits; the others use the
Gumbel-max trick with noise drawn from a key derived from the request's seed
and its output position, so a seeded request reproduces whatever else is in
the batch. Logprobs are of the raw model distribution (before penalties,
bias and temperature), as in vLLM's default.

A step's sampling is launched, not read (``LaunchedStep``): with
asynchronous scheduling the engine builds and launches step n+1 while the
device still runs step n: step n's tokens stay on the device (``tokens``),
step n+1 reads its requests' placeholders from there (the runner's
``fills``), and the host reads them with ``read`` (the sync point) only once
step n+1 is queued behind it. Without it, ``read`` follows the launch at once
and the step is the synchronous one.

Over 400 lines because the launched step (``LaunchedStep``) is the sampler's one call split in two
for asynchronous scheduling: launched where the step is built, read where it is postprocessed.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from mlxd.engined.fastpath.encode_thread import EncodeThread
from mlxd.engined.request import Request
from mlxd.engined.scheduler import SchedulerOutput
from mlxd.shared.protocol import Logprob

_NEG = -1e30
_MASK64 = (1 << 64) - 1


def row_key(seed: int, position: int) -> mx.array:
    # A position-dependent seed: splitmix-style mixing keeps nearby seeds apart.
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x ^= x >> 31
    return mx.random.key(x)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], grammars=None, choose_on_device: bool = False):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        # engined.structured.GrammarCompiler: masks rows of constrained requests.
        self.grammars = grammars
        # Asynchronous scheduling: the step before may still run, and reading which rows' kept sets
        # run past their head would wait for it. Those rows are then sampled over the whole sorted
        # vocabulary on the device as well, and each row takes its answer there.
        self.choose_on_device = choose_on_device

    def __call__(self, logits: mx.array, reqs: list[Request]) -> tuple[mx.array, list | None]:
        """Sample one token per row of ``logits [S, V]``; returns (tokens [S], logprob parts or None).

        Nothing is evaluated here: the caller evaluates tokens together with the
        step's KV writes.
        """
        logits = logits.astype(mx.float32)
        logits = logits[:, : self.vocab_size] if logits.shape[1] > self.vocab_size else logits
        lp_parts = self.raw_logprobs(logits, reqs)
        if all(r.params.temperature == 0.0 for r in reqs):
            return mx.argmax(self._constrain(logits, reqs), axis=-1), lp_parts
        scaled = self._scale(self._constrain(logits, reqs), reqs)
        sampled, past = self._sample_head(scaled, reqs)
        if past:
            # Rows whose kept set runs past their head: sort those rows whole.
            rows = mx.array(past)
            sub = [reqs[i] for i in past]
            full = self._sample_full(self._truncate(scaled[rows], sub, head_first=False), sub)
            sampled = full if sampled is None else _put_rows(sampled, rows, full)
        return sampled, lp_parts

    def _sample_head(self, scaled: mx.array, reqs: list[Request]) -> tuple[mx.array | None, list[int]]:
        """Sample each row among its ``_CANDIDATES`` largest logits; returns (tokens, rows left to the caller).

        Exact for a row that truncates (top-k/top-p/min-p) and whose kept set
        ends inside its head; then neither the noise nor the cutoff needs the
        whole vocabulary. Greedy rows take their head's first token. The rows
        listed (all of them where the head would not help) still need sampling
        over the whole vocabulary.
        """
        v = scaled.shape[1]
        greedy = [r.params.temperature == 0.0 for r in reqs]
        top_k = [1 if g else max(r.params.top_k, 0) for g, r in zip(greedy, reqs)]
        truncates = [g or k or r.params.top_p < 1.0 or r.params.min_p > 0.0
                     for g, k, r in zip(greedy, top_k, reqs)]
        width = min(v, max(_CANDIDATES, max(top_k)))
        if width == v or not any(truncates):
            return None, list(range(len(reqs)))
        ids = mx.argpartition(-scaled, width - 1, axis=-1)[:, :width]
        head = mx.take_along_axis(scaled, ids, axis=-1)
        order = mx.argsort(-head, axis=-1)
        ids, head = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(head, order, axis=-1)
        keep = _kept_prefix(head, mx.logsumexp(scaled, axis=-1, keepdims=True), *self._limits(reqs, top_k, v))
        noise = self._noise(reqs, width)
        choice = mx.argmax(mx.where(keep, head, _NEG) + noise, axis=-1)
        sampled = mx.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
        if self.choose_on_device:
            return self._overflow_on_device(sampled, keep[:, -1], scaled, reqs, truncates)
        # The step's one host sync in sampling: which rows' kept sets run past their head.
        overflow = np.array(keep[:, -1]).tolist()
        return sampled, [i for i, (t, o) in enumerate(zip(truncates, overflow)) if o or not t]

    def _overflow_on_device(self, sampled: mx.array, overflow: mx.array, scaled: mx.array, reqs: list[Request],
                            truncates: list[bool]) -> tuple[mx.array, list[int]]:
        """``_sample_head``'s answer without the host read: sampled rows that truncate are also
        sampled over their whole sorted row, and those whose kept set runs past the head take that
        sample (the token the host-checked path gives them). Rows that do not truncate are left to
        the caller."""
        untruncated = [i for i, t in enumerate(truncates) if not t]
        rows = [i for i, (t, r) in enumerate(zip(truncates, reqs)) if t and r.params.temperature > 0.0]
        if not rows:  # greedy rows keep one token: never past their head
            return sampled, untruncated
        sub = [reqs[i] for i in rows]
        idx = mx.array(rows)
        full = self._sample_full(self._truncate(scaled[idx], sub, head_first=False), sub)
        return _put_rows(sampled, idx, mx.where(overflow[idx], full, sampled[idx])), untruncated

    def _sample_full(self, processed: mx.array, reqs: list[Request]) -> mx.array:
        """Gumbel-max over the whole vocabulary; greedy rows take the argmax."""
        sampled = mx.argmax(processed + self._noise(reqs, processed.shape[1]), axis=-1)
        greedy = np.array([r.params.temperature == 0.0 for r in reqs])
        if greedy.any():
            sampled = mx.where(mx.array(greedy), mx.argmax(processed, axis=-1), sampled)
        return sampled

    @staticmethod
    def _noise(reqs: list[Request], width: int) -> mx.array:
        # Keyed by the request's seed and output position: a seeded request reproduces whatever else is in
        # the batch, and whether or not its previous token was still on the device (asynchronous scheduling).
        return mx.stack([mx.random.gumbel((width,), key=row_key(r.seed, r.output_position)) for r in reqs])

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
        logits = self._constrain(logits, reqs, allowed)
        if all(r.params.temperature == 0.0 for r in reqs):
            return logits
        return self._truncate(self._scale(logits, reqs), reqs)

    def _constrain(self, logits: mx.array, reqs: list[Request], allowed: mx.array | None = None) -> mx.array:
        """The grammar masks (or ``allowed``), then penalties, bias and min_tokens."""
        if allowed is None and self.grammars is not None and any(r.grammar is not None for r in reqs):
            allowed = self.grammars.token_bitmask([r.grammar for r in reqs])
        if allowed is not None:
            logits = mx.where(allowed, logits, _NEG)
        return self._penalize(logits, reqs)

    @staticmethod
    def _scale(logits: mx.array, reqs: list[Request]) -> mx.array:
        """Divide by each row's temperature; greedy rows keep theirs (their argmax is what counts)."""
        temps = mx.array([r.params.temperature or 1.0 for r in reqs], dtype=mx.float32)[:, None]
        return logits / temps

    @staticmethod
    def _limits(reqs: list[Request], top_k: list[int], v: int) -> tuple[mx.array, mx.array, mx.array]:
        """Per-row (top_k with 0 as the whole row, top_p with 1 as no limit, min_p) as ``[S, 1]`` columns.

        A top_p of 1 is infinite here: a float32 cumulative sum of a peaked row reaches 1.0 before its
        tail, and ``before < 1.0`` would then drop tokens that top_p 1 keeps."""
        return (mx.array([k or v for k in top_k])[:, None],
                mx.array([r.params.top_p if r.params.top_p < 1.0 else np.inf for r in reqs], dtype=mx.float32)[:, None],
                mx.array([r.params.min_p for r in reqs], dtype=mx.float32)[:, None])

    def _penalize(self, logits: mx.array, reqs: list[Request]) -> mx.array:
        """Repetition/presence/frequency penalties, logit bias and min_tokens.

        Built on the device by scattering each row's token ids into ``[S, V]``
        counts: the host only concatenates id lists, it never fills a dense
        vocabulary-wide array.
        """
        s, v = logits.shape
        needs = [
            (r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
             or r.params.logit_bias or r.output_position < r.params.min_tokens)
            for r in reqs
        ]
        if not any(needs):
            return logits
        seen, generated, biased, banned = _Scatter(), _Scatter(), _Scatter(), _Scatter()
        rep = np.ones(s, np.float32)
        freq = np.zeros(s, np.float32)
        pres = np.zeros(s, np.float32)
        for i, r in enumerate(reqs):
            if not needs[i]:
                continue
            p = r.params
            if p.repetition_penalty != 1.0:
                rep[i] = p.repetition_penalty
                seen.add(i, r.token_ids)
            if p.presence_penalty or p.frequency_penalty:
                freq[i], pres[i] = p.frequency_penalty, p.presence_penalty
                generated.add(i, r.output_token_ids)
            if p.logit_bias:
                biased.add(i, list(p.logit_bias.keys()), list(p.logit_bias.values()))
            if r.output_position < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                banned.add(i, sorted(stops))
        if seen:
            # Repetition: divide positive logits, multiply negative ones, for every token seen so far.
            scale = mx.where(seen.counts(s, v) > 0, mx.array(rep)[:, None], 1.0)
            logits = mx.where(logits > 0, logits / scale, logits * scale)
        if generated:
            counts = generated.counts(s, v)
            logits = logits - mx.array(freq)[:, None] * counts - mx.array(pres)[:, None] * (counts > 0)
        if biased:
            logits = logits + biased.counts(s, v)
        if banned:
            logits = mx.where(banned.counts(s, v) > 0, _NEG, logits)
        return logits

    def _truncate(self, logits: mx.array, reqs: list[Request], head_first: bool = True) -> mx.array:
        """top_k, top_p and min_p on temperature-scaled logits; masked entries get -inf.

        Each kept set is a prefix of its row's descending order, so a row keeps
        every token at or above its cutoff logit: no inverse permutation. The
        cutoff is looked for among the row's ``_CANDIDATES`` largest logits
        (a partial selection, ~10x cheaper than sorting the vocabulary); only a
        step with a row whose kept prefix runs past them (a flat distribution)
        sorts whole rows, at once when ``head_first`` is False (the caller
        knows). Tokens tied with the cutoff are all kept.
        """
        top_k = [r.params.top_k if r.params.top_k > 0 else 0 for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        min_p = [r.params.min_p for r in reqs]
        if max(top_k) == 0 and min(top_p) >= 1.0 and max(min_p) == 0.0:
            return logits
        v = logits.shape[1]
        k, p, m = self._limits(reqs, top_k, v)
        lse = mx.logsumexp(logits, axis=-1, keepdims=True)
        width = min(v, max(_CANDIDATES, max(top_k))) if head_first else v
        head = _descending(mx.topk(logits, width, axis=-1) if width < v else logits)
        keep = _kept_prefix(head, lse, k, p, m)
        if width < v and bool(mx.any(keep[:, -1]).item()):
            head = _descending(logits)
            keep = _kept_prefix(head, lse, k, p, m)
        num_kept = keep.sum(axis=-1, keepdims=True)
        cutoff = mx.take_along_axis(head, num_kept - 1, axis=-1)
        return mx.where(logits >= cutoff, logits, _NEG)


# Candidates per row in which top-k/top-p/min-p look for their cutoff first.
_CANDIDATES = 1024


def _descending(x: mx.array) -> mx.array:
    return -mx.sort(-x, axis=-1)


def _put_rows(x: mx.array, rows: mx.array, values: mx.array) -> mx.array:
    x[rows] = values
    return x


def _kept_prefix(head: mx.array, lse: mx.array, k: mx.array, p: mx.array, m: mx.array) -> mx.array:
    """Which of a row's largest logits (``head``, descending) top-k, top-p and min-p keep.

    Probabilities are of the whole row (``lse``, its log-sum-exp), so the
    answer over a row's head equals the answer over the whole sorted row
    wherever the head does not end kept. The first token always stays.
    """
    probs = mx.exp(head - lse)
    rank = mx.arange(head.shape[1])[None, :]
    before = mx.cumsum(probs, axis=-1) - probs
    return (rank < k) & (before < p) & (probs >= m * probs[:, :1])


class _Scatter:
    """(row, token id, value) triples gathered on the host, summed into ``[S, V]`` on the device."""

    def __init__(self):
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []

    def __bool__(self) -> bool:
        return bool(self.rows)

    def add(self, row: int, ids, values=None) -> None:
        cols = np.asarray(ids, dtype=np.int64)
        self.rows.append(np.full(len(cols), row, dtype=np.int64))
        self.cols.append(cols)
        self.vals.append(np.ones(len(cols), np.float32) if values is None else np.asarray(values, np.float32))

    def counts(self, s: int, v: int) -> mx.array:
        cols = np.concatenate(self.cols)
        inside = cols < v  # ids past the logits' width (padding) have no row to land in
        rows, vals = np.concatenate(self.rows)[inside], np.concatenate(self.vals)[inside]
        out = mx.zeros((s, v), dtype=mx.float32)
        if not inside.any():
            return out
        return out.at[mx.array(rows), mx.array(cols[inside])].add(mx.array(vals))


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


class LaunchedStep:
    """A batch, its sampled rows' tokens (evaluating) and what turns them into each request's new tokens."""

    __slots__ = ("batch", "reqs", "tokens", "feed", "logprob_parts", "spec_results", "pooled", "_rows",
                 "_pending", "_encoder", "_number")

    def __init__(self, batch: SchedulerOutput, reqs: list[Request], tokens: mx.array | None, feed: mx.array | None,
                 logprob_parts, spec_results: Callable[[], dict] | None, pooled: list | None, pending: list):
        self.batch = batch
        self.reqs = reqs  # the plain sampled requests, in the order of ``tokens``' rows
        self.tokens = tokens
        # The tokens as the next step's placeholders read them on the device: an array of its own, which
        # the host never waits on, so that reading ``tokens`` here touches nothing the encode thread's
        # evaluation of the next step walks (``Engine.step`` hands that step over before reading this one).
        self.feed = feed
        self.logprob_parts = logprob_parts
        self.spec_results = spec_results  # verified draft windows' results, read after evaluation
        self._rows = {r: i for i, r in enumerate(reqs)}
        # Pooled requests' results (engined.encoders.pooling.pooled_results), stored when the step is read.
        self.pooled = pooled
        self._pending = pending  # what ``start`` evaluates
        self._encoder: EncodeThread | None = None
        self._number = 0

    def start(self, encoder: EncodeThread | None = None) -> None:
        """Queue the step on the device: evaluated asynchronously here, or handed to ``encoder``'s thread."""
        pending, self._pending = self._pending, None
        if encoder is None:
            mx.async_eval(pending)
        else:
            self._encoder, self._number = encoder, encoder.submit(pending)

    @classmethod
    def sample(cls, batch: SchedulerOutput, rows: list[tuple[Request, int]], logits: mx.array, sampler,
               speculator, kv_arrays: list[mx.array], pooled: list | None = None) -> "LaunchedStep":
        """Build the step's sampling: plain rows through ``sampler``, draft windows through
        ``speculator.verify``, to be evaluated with the KV writes (``kv_arrays``) and the pooled
        requests' results (``pooled``: evaluated with the step, so that storing them only waits) by
        ``start``. ``rows``: (request, its first logits row)."""
        plain = [(r, o) for r, o in rows if r not in batch.drafts]
        spec = [(r, o) for r, o in rows if r in batch.drafts]
        pending = [kv_arrays] + ([[r for _, r in pooled]] if pooled else [])
        reqs = [r for r, _ in plain]
        tokens, feed, logprob_parts, spec_results = None, None, None, None
        if plain:
            tokens, logprob_parts = sampler(logits[mx.array([o for _, o in plain])], reqs)
            feed = mx.stop_gradient(tokens)
            pending += [tokens, feed, logprob_parts or []]
        if spec:
            arrays, spec_results = speculator.verify(logits, spec, batch.drafts)
            pending += arrays
        return cls(batch, reqs, tokens, feed, logprob_parts, spec_results, pooled, pending)

    def row_of(self, req: Request) -> int:
        """The row of ``tokens`` holding the request's token (the next step's placeholder)."""
        return self._rows[req]

    def read(self) -> dict[Request, tuple[list[int], list]]:
        """The sync point: wait for the step and read its tokens; {request: (tokens, Logprob records or Nones)}."""
        if self._encoder is not None:
            self._encoder.wait(self._number)
        emitted = {}
        if self.reqs:
            toks = self.tokens.tolist()
            lps = (logprobs_for(self.logprob_parts, toks, self.reqs) if self.logprob_parts
                   else [None] * len(self.reqs))
            emitted = {req: ([tok], [lp]) for req, tok, lp in zip(self.reqs, toks, lps)}
        if self.spec_results is not None:
            emitted.update(self.spec_results())
        return emitted


def needs_host_tokens(req: Request) -> bool:
    """Whether the request's next step needs its last token on the host: a grammar masks by it,
    penalties count it. Such a request's step in flight is read before the next is scheduled."""
    p = req.params
    return (req.grammar is not None or p.repetition_penalty != 1.0 or bool(p.presence_penalty)
            or bool(p.frequency_penalty))
