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

from mlxd.engined.kv.manager import PagedArrays
from mlxd.engined.model_layers import LayerSpec
from mlxd.engined.request import Request
from mlxd.engined.runner import forward_pooled, install
from mlxd.engined.sampler import Sampler, row_key
from mlxd.engined.structured import DraftWalk
from mlxd.engined.kernels import AttentionMetadata
from mlxd.shared.errors import ModelLoadError

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

    def _forward(self, pieces: list[list[int]], offsets: list[int], tables: list[list[int]],
                 drafted: mx.array | None) -> mx.array:
        """Logits of each piece's last row; ``drafted`` (one per piece, on the device), if given, are
        the pieces' tokens (each then of one placeholder token)."""
        lens = [len(p) for p in pieces]
        meta = AttentionMetadata.build(lens, [o + n for o, n in zip(offsets, lens)], tables, self.block_size)
        caches = [None] * self.num_layers
        self.kv.steps(meta, caches)
        fills = None if drafted is None else (list(range(len(pieces))), drafted)
        return forward_pooled(self.model, self.head, pieces, caches, [1] * len(pieces), fills=fills)[0]

    def propose(self, reqs: list[Request], drafts: list[list[int]],
                tables: list[list[int]]) -> tuple[mx.array | None, dict[Request, np.ndarray]]:
        """Fill each request's draft (already sized) in place; returns their distributions and masks
        (``draft_loop``'s). The first pass catches each request's draft K/V up from where it stopped."""
        offsets = [min(self.computed.get(r.request_id, 0), r.num_computed_tokens) for r in reqs]
        pieces = [r.token_ids[o:] for r, o in zip(reqs, offsets)]

        def forward(j: int, active: list[int], previous: mx.array | None) -> mx.array:
            if j:
                for i in active:
                    offsets[i] += len(pieces[i])
                    pieces[i] = [0]  # one token each, filled on the device from ``previous``
            return self._forward([pieces[i] for i in active], [offsets[i] for i in active],
                                 [tables[i] for i in active], previous)

        probs, bits = draft_loop(self.sampler, reqs, drafts, forward, self.kv.arrays)
        for req, off, piece in zip(reqs, offsets, pieces):
            self.computed[req.request_id] = off + len(piece)
        return probs, bits


def draft_loop(sampler: Sampler, reqs: list[Request], drafts: list[list[int]],
               forward: Callable[[int, list[int], mx.array | None], mx.array],
               arrays: Callable[[], list[mx.array]]) -> tuple[mx.array | None, dict[Request, np.ndarray]]:
    """Fill each request's draft (already sized) in place, one position at a time, by a drafter's
    ``forward(j, active, previous)``: the logits of position ``j`` for the requests ``active``
    (indices into ``reqs``), whose tokens of position ``j - 1`` are ``previous`` (int32
    ``[len(active)]`` on the device; None for ``j = 0``). ``arrays`` are what the forwards write
    (K/V), evaluated with the drafts.

    Without a grammar nothing on the host depends on a draft token until the
    round is over: each position's tokens feed the next forward as an array,
    each position is queued (``mx.async_eval``) as soon as its graph is built,
    and the host waits once, for all ``k`` positions, at the end. A round with
    a constrained request waits at every position instead: its grammar walk
    takes each token on the host to mask the next position.

    Returns the distributions in the verifier's row layout (per request ``k``
    rows of the draft's distribution and one zero row for the bonus position;
    None when every request is greedy, as the verifier then needs none) and,
    for constrained requests, which draft under their grammar, the packed
    masks of the window rows (``[k + 1, words]``).
    """
    ks = [len(d) for d in drafts]
    vocab = sampler.vocab_size
    walks = {i: DraftWalk(r.grammar.matcher, sampler.grammars.new_bits(k + 1))
             for i, (r, k) in enumerate(zip(reqs, ks)) if r.grammar is not None}
    # Greedy drafts need neither noise nor a distribution: the verifier keeps the target's argmax.
    sampled = any(r.params.temperature != 0.0 for r in reqs)
    positions: list[tuple[list[int], mx.array, mx.array | None]] = []  # per position: (active, tokens, probs)
    previous = None
    try:
        for j in range(max(ks)):
            active = [i for i, k in enumerate(ks) if k > j]
            if positions:
                previous = rows_for(previous, positions[-1][0], active)
            logits = forward(j, active, previous)
            areqs = [reqs[i] for i in active]
            processed = sampler.process(logits.astype(mx.float32)[:, :vocab], areqs,
                                        _row_masks(sampler, j, active, walks))
            previous, probs = mx.argmax(processed, axis=-1), None
            if sampled:
                probs = mx.softmax(processed, axis=-1)
                noise = mx.stack([
                    mx.random.gumbel((vocab,), key=row_key(r.seed + _DRAFT_SEED_OFFSET, r.num_output_tokens + j))
                    for r in areqs
                ])
                greedy = mx.array([r.params.temperature == 0.0 for r in areqs])
                previous = mx.where(greedy, previous, mx.argmax(processed + noise, axis=-1))
            previous = previous.astype(mx.int32)
            positions.append((active, previous, probs))
            if walks:
                mx.eval(previous, probs, arrays())
                for i, tok in zip(active, previous.tolist()):
                    if i in walks:
                        walks[i].push(tok)
            else:
                mx.async_eval(previous, probs, arrays())
        tokens = mx.concatenate([t for _, t, _ in positions])
        probs = _verifier_layout(positions, ks, vocab) if sampled else None
        mx.eval(tokens, probs, arrays())
    finally:
        # The matchers go back to the last accepted token whatever happened.
        for walk in walks.values():
            walk.finish()
    flat = iter(tokens.tolist())
    for j, (active, _, _) in enumerate(positions):
        for i in active:
            drafts[i][j] = next(flat)
    return probs, {reqs[i]: walk.bits for i, walk in walks.items()}


def _verifier_layout(positions: list[tuple[list[int], mx.array, mx.array]], ks: list[int], vocab: int) -> mx.array:
    """Each position's distributions ``[len(active), V]`` in the verifier's row layout: per request its
    ``k`` rows, then a zero row for its bonus position; one gather."""
    at, first = {}, 0
    for j, (active, _, _) in enumerate(positions):
        for row, i in enumerate(active):
            at[i, j] = first + row
        first += len(active)
    index = [at[i, j] if j < k else first for i, k in enumerate(ks) for j in range(k + 1)]  # first: the zero row
    stacked = mx.concatenate([p for _, _, p in positions] + [mx.zeros((1, vocab), dtype=mx.float32)])
    return stacked[mx.array(np.array(index, dtype=np.int32))]


def rows_for(array: mx.array, of: list[int], active: list[int]) -> mx.array:
    """The rows of ``array`` (one per request of ``of``) of the requests ``active``, a subsequence
    of ``of``: a draft round's active requests only shrink, keeping their order."""
    if len(active) == len(of):
        return array
    at = {i: row for row, i in enumerate(of)}
    return array[mx.array(np.array([at[i] for i in active], dtype=np.int32))]


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
