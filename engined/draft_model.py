"""Draft-model speculation: a smaller model of the same vocabulary drafts ``k`` tokens per request.

Its paged K/V lives in its own per-layer arrays indexed by the target's block
ids (the target's full-attention tables), so one block allocation covers both
models: the memory guard bills a block for both. Per request it remembers how
many tokens' draft K/V are written; the first pass of a step catches up from
there. A preempted request starts over: its blocks may be others by then.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engined.kv.full_attention import PagedArrays
from engined.model_layers import LayerSpec
from engined.request import Request
from engined.runner import forward, install
from engined.sampler import Sampler, row_key
from engined.structured import DraftWalk
from kernels import AttentionMetadata
from shared.errors import ModelLoadError

# Keeps the draft's sampling noise independent of the verifier's for the same seed and position.
_DRAFT_SEED_OFFSET = 0x5DEECE66D


class DraftProposer:
    def __init__(self, model: nn.Module, specs: list[LayerSpec], block_size: int, dtype: mx.Dtype,
                 sampler: Sampler, attention_backend: str = "auto"):
        if any(s.linear is not None for s in specs):
            raise ModelLoadError("a draft model with linear-attention layers is not supported: a recurrent "
                                 "state cannot take rejected draft tokens back")
        self.model = model
        self.kv = PagedArrays(specs, block_size, dtype)
        self.head = install(model, specs, attention_backend)
        self.block_size = block_size
        self.num_layers = len(specs)
        self.sampler = sampler
        self.computed: dict[str, int] = {}  # request -> tokens whose draft K/V is written

    # The memory guard's view, as for a KV manager: billed per block, nothing fixed; its arrays
    # follow the target's main pool as it grows and shrinks (``KVCacheManager.follow``).
    @property
    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block

    @property
    def resize_bytes_per_block(self) -> int:
        return self.kv.array_bytes_per_block

    fixed_bytes = 0

    def create(self, num_blocks: int) -> None:
        self.kv.create(num_blocks)

    def arrays(self) -> list[mx.array]:
        return self.kv.arrays()

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def retain(self, request_ids) -> None:
        """Forget every request but these (finished or aborted ones, and preempted ones still waiting)."""
        keep = set(request_ids)
        self.computed = {rid: n for rid, n in self.computed.items() if rid in keep}

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.computed.pop(rid, None)

    def _forward(self, pieces: list[list[int]], offsets: list[int], tables: list[list[int]]) -> mx.array:
        lens = [len(p) for p in pieces]
        meta = AttentionMetadata.build(lens, [o + n for o, n in zip(offsets, lens)], tables, self.block_size)
        caches = [None] * self.num_layers
        self.kv.steps(meta, caches)
        return forward(self.model, self.head, pieces, caches, [1] * len(pieces))

    def propose(self, reqs: list[Request], drafts: list[list[int]],
                tables: list[list[int]]) -> tuple[mx.array, dict[Request, np.ndarray]]:
        """Fill each request's draft (already sized) in place; returns their distributions and masks
        (``draft_loop``'s). The first pass catches each request's draft K/V up from where it stopped."""
        offsets = [min(self.computed.get(r.request_id, 0), r.num_computed_tokens) for r in reqs]
        pieces = [r.token_ids[o:] for r, o in zip(reqs, offsets)]

        def forward(j: int, active: list[int]) -> mx.array:
            if j:
                for i in active:
                    offsets[i] += len(pieces[i])
                    pieces[i] = [drafts[i][j - 1]]
            return self._forward([pieces[i] for i in active], [offsets[i] for i in active],
                                 [tables[i] for i in active])

        probs, bits = draft_loop(self.sampler, reqs, drafts, forward, self.kv.arrays)
        for req, off, piece in zip(reqs, offsets, pieces):
            self.computed[req.request_id] = off + len(piece)
        return probs, bits


def draft_loop(sampler: Sampler, reqs: list[Request], drafts: list[list[int]],
               forward: Callable[[int, list[int]], mx.array],
               arrays: Callable[[], list[mx.array]]) -> tuple[mx.array, dict[Request, np.ndarray]]:
    """Fill each request's draft (already sized) in place, one position at a time, by a drafter's
    ``forward(j, active)``: the logits of position ``j`` for the requests ``active`` (indices into
    ``reqs``; their drafts before ``j`` are filled). ``arrays`` are what the forwards write (K/V),
    evaluated with each position's tokens.

    Returns the distributions in the verifier's row layout (per request ``k``
    rows of the draft's distribution and one zero row for the bonus position)
    and, for constrained requests, which draft under their grammar, the packed
    masks of the window rows (``[k + 1, words]``).
    """
    ks = [len(d) for d in drafts]
    rows: list[list[mx.array]] = [[] for _ in reqs]
    vocab = sampler.vocab_size
    walks = {i: DraftWalk(r.grammar.matcher, sampler.grammars.new_bits(k + 1))
             for i, (r, k) in enumerate(zip(reqs, ks)) if r.grammar is not None}
    try:
        for j in range(max(ks)):
            active = [i for i, k in enumerate(ks) if k > j]
            logits = forward(j, active)
            areqs = [reqs[i] for i in active]
            processed = sampler.process(logits.astype(mx.float32)[:, :vocab], areqs,
                                        _row_masks(sampler, j, active, walks))
            probs = mx.softmax(processed, axis=-1)
            noise = mx.stack([
                mx.random.gumbel((vocab,), key=row_key(r.seed + _DRAFT_SEED_OFFSET, r.num_output_tokens + j))
                for r in areqs
            ])
            greedy = mx.array([r.params.temperature == 0.0 for r in areqs])
            tokens = mx.where(greedy, mx.argmax(processed, axis=-1), mx.argmax(processed + noise, axis=-1))
            mx.eval(tokens, probs, arrays())
            for row, (i, tok) in enumerate(zip(active, tokens.tolist())):
                drafts[i][j] = tok
                rows[i].append(probs[row])
                if i in walks:
                    walks[i].push(tok)
    finally:
        # The matchers go back to the last accepted token whatever happened.
        for walk in walks.values():
            walk.finish()
    zero = mx.zeros((vocab,), dtype=mx.float32)
    probs = mx.stack([row for per_req in rows for row in per_req + [zero]])
    return probs, {reqs[i]: walk.bits for i, walk in walks.items()}


def _row_masks(sampler: Sampler, j: int, active: list[int], walks: dict[int, DraftWalk]) -> mx.array | None:
    """Allowed tokens for draft position ``j`` of the active requests; None when none is constrained."""
    if not any(i in walks for i in active):
        return None
    bits = sampler.grammars.new_bits(len(active))
    for row, i in enumerate(active):
        if i in walks:
            walks[i].fill()
            bits[row] = walks[i].bits[j]
    return sampler.grammars.to_mask(bits)
