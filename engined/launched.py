"""A step launched on the device whose sampled tokens the host has not read yet.

With asynchronous scheduling the engine builds and launches step n+1 while
the device still runs step n: step n's tokens stay on the device
(``tokens``), step n+1 reads its requests' placeholders from there (the
runner's ``fills``), and the host reads them with ``read`` (the sync point)
only once step n+1 is queued behind it. Without it, ``read`` follows the
launch at once and the step is the synchronous one.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from engined.request import Request
from engined.sampler import logprobs_for
from engined.scheduler import SchedulerOutput


class LaunchedStep:
    """A batch, its sampled rows' tokens (evaluating) and what turns them into each request's new tokens."""

    __slots__ = ("batch", "reqs", "tokens", "logprob_parts", "spec_results", "pooled", "_rows")

    def __init__(self, batch: SchedulerOutput, reqs: list[Request], tokens: mx.array | None, logprob_parts,
                 spec_results: Callable[[], dict] | None, pending: list):
        self.batch = batch
        self.reqs = reqs  # the plain sampled requests, in the order of ``tokens``' rows
        self.tokens = tokens
        self.logprob_parts = logprob_parts
        self.spec_results = spec_results  # verified draft windows' results, read after evaluation
        self._rows = {r: i for i, r in enumerate(reqs)}
        # Pooled requests' results (engined.pooling.pooled_results), stored when the step is read.
        self.pooled = None
        mx.async_eval(pending)

    @classmethod
    def sample(cls, batch: SchedulerOutput, rows: list[tuple[Request, int]], logits: mx.array, sampler,
               speculator, kv_arrays: list[mx.array]) -> "LaunchedStep":
        """Launch the step's sampling: plain rows through ``sampler``, draft windows through
        ``speculator.verify``, evaluated with the KV writes (``kv_arrays``). ``rows``: (request,
        its first logits row)."""
        plain = [(r, o) for r, o in rows if r not in batch.drafts]
        spec = [(r, o) for r, o in rows if r in batch.drafts]
        pending = [kv_arrays]
        reqs = [r for r, _ in plain]
        tokens, logprob_parts, spec_results = None, None, None
        if plain:
            tokens, logprob_parts = sampler(logits[mx.array([o for _, o in plain])], reqs)
            pending += [tokens, logprob_parts or []]
        if spec:
            arrays, spec_results = speculator.verify(logits, spec, batch.drafts)
            pending += arrays
        return cls(batch, reqs, tokens, logprob_parts, spec_results, pending)

    def row_of(self, req: Request) -> int:
        """The row of ``tokens`` holding the request's token (the next step's placeholder)."""
        return self._rows[req]

    def read(self) -> dict[Request, tuple[list[int], list]]:
        """The sync point: wait for the step and read its tokens; {request: (tokens, Logprob records or Nones)}."""
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
