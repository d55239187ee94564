"""Draft-model speculation: a smaller model of the same vocabulary drafts ``k`` tokens per request.

Its paged K/V lives in its own per-layer arrays indexed by the target's block
ids (the target's full-attention tables), so one block allocation covers both
models: the memory guard bills a block for both. Per request it remembers how
many tokens' draft K/V are written; the first pass of a step catches up from
there. A preempted request starts over: its blocks may be others by then.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engined import attention
from engined.kv.full_attention import PagedArrays
from engined.model_layers import LayerSpec
from engined.request import Request
from engined.runner import forward
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
        self.head = attention.install(model, specs, attention_backend)
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
        """Fill each request's draft (already sized) in place; returns their distributions and masks.

        The distributions have the verifier's row layout: per request ``k`` rows
        of the draft's distribution and one zero row for the bonus position.
        Constrained requests draft under their grammar; the masks (packed,
        ``[k + 1, words]`` per constrained request) are those of the window rows.
        """
        ks = [len(d) for d in drafts]
        offsets = [min(self.computed.get(r.request_id, 0), r.num_computed_tokens) for r in reqs]
        pieces = [r.token_ids[o:] for r, o in zip(reqs, offsets)]
        rows: list[list[mx.array]] = [[] for _ in reqs]
        vocab = self.sampler.vocab_size
        walks = {i: DraftWalk(r.grammar.matcher, self.sampler.grammars.new_bits(k + 1))
                 for i, (r, k) in enumerate(zip(reqs, ks)) if r.grammar is not None}
        try:
            for j in range(max(ks)):
                active = [i for i, k in enumerate(ks) if k > j]
                logits = self._forward([pieces[i] for i in active], [offsets[i] for i in active],
                                       [tables[i] for i in active])
                areqs = [reqs[i] for i in active]
                processed = self.sampler.process(logits.astype(mx.float32)[:, :vocab], areqs,
                                                 self._row_masks(j, active, walks))
                probs = mx.softmax(processed, axis=-1)
                noise = mx.stack([
                    mx.random.gumbel((vocab,), key=row_key(r.seed + _DRAFT_SEED_OFFSET, r.num_output_tokens + j))
                    for r in areqs
                ])
                greedy = mx.array([r.params.temperature == 0.0 for r in areqs])
                tokens = mx.where(greedy, mx.argmax(processed, axis=-1), mx.argmax(processed + noise, axis=-1))
                mx.eval(tokens, probs, self.kv.arrays())
                for row, (i, tok) in enumerate(zip(active, tokens.tolist())):
                    drafts[i][j] = tok
                    rows[i].append(probs[row])
                    offsets[i] += len(pieces[i])
                    pieces[i] = [tok]
                    if i in walks:
                        walks[i].push(tok)
        finally:
            # The matchers go back to the last accepted token whatever happened.
            for walk in walks.values():
                walk.finish()
        zero = mx.zeros((vocab,), dtype=mx.float32)
        for req, off in zip(reqs, offsets):
            self.computed[req.request_id] = off
        probs = mx.stack([row for per_req in rows for row in per_req + [zero]])
        return probs, {reqs[i]: walk.bits for i, walk in walks.items()}

    def _row_masks(self, j: int, active: list[int], walks: dict[int, DraftWalk]) -> mx.array | None:
        """Allowed tokens for draft position ``j`` of the active requests; None when none is constrained."""
        if not any(i in walks for i in active):
            return None
        bits = self.sampler.grammars.new_bits(len(active))
        for row, i in enumerate(active):
            if i in walks:
                walks[i].fill()
                bits[row] = walks[i].bits[j]
        return self.sampler.grammars.to_mask(bits)
