"""Runs one packed step: the tokens and each layer's step object in, the sampled rows' logits out."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engined import attention
from engined.kv import KVCacheManager
from engined.model_layers import LayerSpec
from engined.scheduler import SchedulerOutput


def forward(model: nn.Module, head: attention.LastTokenNorm, pieces: list[list[int]], caches: list,
            num_logits: list[int], fills: tuple[list[int], mx.array] | None = None) -> mx.array:
    """Forward token ``pieces`` packed as one sequence; logits of each piece's last ``num_logits[b]`` rows.

    ``caches`` is the model's ``cache`` argument: one step object per layer.
    ``fills`` = (packed positions, tokens [len]) puts device-side tokens (a
    step still in flight sampled them) at those positions. Returns
    ``[sum(num_logits), vocab]``, not yet evaluated.
    """
    lens = [len(p) for p in pieces]
    tokens = mx.array(np.fromiter((t for piece in pieces for t in piece), dtype=np.int32, count=sum(lens)))
    if fills is not None:
        at, values = fills
        tokens[mx.array(np.array(at, dtype=np.int32))] = values.astype(mx.int32)
    ends = np.cumsum(lens)
    rows = [np.arange(end - k, end) for end, k in zip(ends, num_logits) if k]
    head.rows = mx.array(np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32))
    try:
        return model(tokens[None], cache=caches)[0]
    finally:
        head.rows = None


class ModelRunner:
    """The model with its attention swapped for paged attention, run over the KV manager's groups."""

    def __init__(self, model: nn.Module, specs: list[LayerSpec], kv: KVCacheManager, attention_backend: str = "auto"):
        self.model = model
        self.kv = kv
        self.head = attention.install(model, specs, attention_backend)

    def run(self, batch: SchedulerOutput, num_logits: list[int] | None = None, inflight=None) -> mx.array:
        """Forward the batch; logits ``[sum(num_logits), vocab]`` (not yet evaluated).

        ``batch.scheduled[b] = (request, n)`` computes ``n`` tokens from the
        request's ``num_computed_tokens`` on: its known tokens, then its drafts
        (``batch.drafts``) or its placeholder, the token the step in flight
        (``inflight``, an ``engined.launched.LaunchedStep``) sampled for it, read
        from the device. ``num_logits`` (default: the rows the batch samples,
        ``batch.num_logits``) says how many of each request's last rows to return.
        """
        pieces, at, rows = [], [], []
        offset = 0
        for r, n in batch.scheduled:
            known = r.token_ids[r.num_computed_tokens : r.num_computed_tokens + n]
            if len(known) < n and r in batch.drafts:
                known = known + batch.drafts[r][: n - len(known)]
            elif len(known) < n:  # one placeholder, the last token
                at.append(offset + n - 1)
                rows.append(inflight.row_of(r))
                known = known + [0]
            pieces.append(known)
            offset += n
        fills = (at, inflight.tokens[mx.array(rows)]) if at else None
        caches = self.kv.step_caches(batch.scheduled)
        return forward(self.model, self.head, pieces, caches, batch.num_logits if num_logits is None else num_logits,
                       fills)
