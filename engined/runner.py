"""Runs one packed step: the tokens and each layer's step object in, the sampled rows' logits out."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engined import attention
from engined.kv import KVCacheManager
from engined.lora.registry import LoraRegistry
from engined.lora.step_order import SlotOrder
from engined.model_layers import LayerSpec
from engined.scheduler import SchedulerOutput


def _row_index(ends: np.ndarray, counts: list[int]) -> mx.array:
    """Indices of each piece's last ``counts[b]`` rows in the packed sequence."""
    rows = [np.arange(end - k, end) for end, k in zip(ends, counts) if k]
    return mx.array(np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32))


def forward(model: nn.Module, head: attention.LastTokenNorm, pieces: list[list[int]], caches: list,
            num_logits: list[int]) -> mx.array:
    """Forward token ``pieces`` packed as one sequence; logits of each piece's last ``num_logits[b]`` rows.

    ``caches`` is the model's ``cache`` argument: one step object per layer.
    Returns ``[sum(num_logits), vocab]``, not yet evaluated.
    """
    return forward_pooled(model, head, pieces, caches, num_logits)[0]


def forward_pooled(model: nn.Module, head: attention.LastTokenNorm, pieces: list[list[int]], caches: list,
                   num_logits: list[int], num_hidden: list[int] | None = None,
                   fills: tuple[list[int], mx.array] | None = None) -> tuple[mx.array, mx.array | None]:
    """``forward``, and when ``num_hidden`` asks for any, the final normed hidden states
    ``[sum(num_hidden), hidden]`` of each piece's last ``num_hidden[b]`` rows (else None).

    ``fills`` = (packed positions, tokens [len]) puts device-side tokens (a
    step still in flight sampled them) at those positions.
    """
    lens = [len(p) for p in pieces]
    tokens = mx.array(np.fromiter((t for piece in pieces for t in piece), dtype=np.int32, count=sum(lens)))
    if fills is not None:
        at, values = fills
        tokens[mx.array(np.array(at, dtype=np.int32))] = values.astype(mx.int32)
    ends = np.cumsum(lens)
    head.rows = _row_index(ends, num_logits)
    if num_hidden and any(num_hidden):
        head.hidden_rows = _row_index(ends, num_hidden)
    try:
        logits = model(tokens[None], cache=caches)[0]
        return logits, (head.hidden[0] if head.hidden is not None else None)
    finally:
        head.rows = head.hidden_rows = head.hidden = None


class ModelRunner:
    """The model with its attention swapped for paged attention, run over the KV manager's groups."""

    def __init__(self, model: nn.Module, specs: list[LayerSpec], kv: KVCacheManager, attention_backend: str = "auto",
                 lora: LoraRegistry | None = None):
        self.model = model
        self.kv = kv
        self.head = attention.install(model, specs, attention_backend)
        # The adapters' slots (their layers are already in the model); None: LoRA is off.
        self.lora = lora

    def run(self, batch: SchedulerOutput, num_logits: list[int] | None = None) -> mx.array:
        """Forward the batch; logits ``[sum(num_logits), vocab]`` (not yet evaluated).

        ``batch.scheduled[b] = (request, n)`` computes ``n`` tokens from the
        request's ``num_computed_tokens`` on: its known tokens, then its drafts
        (``batch.drafts``). ``num_logits`` (default: the rows the batch samples,
        ``batch.num_logits``) says how many of each request's last rows to return.
        """
        return self.run_pooled(batch, num_logits)[0]

    def run_pooled(self, batch: SchedulerOutput, num_logits: list[int] | None = None, inflight=None
                   ) -> tuple[mx.array, mx.array | None]:
        """``run``, plus the final hidden states of the rows ``batch.hidden_rows`` asks for (embed
        requests' last tokens, in batch order; None when none does). A request's placeholder (its
        last token, sampled by the step in flight ``inflight``, an ``engined.launched.LaunchedStep``)
        is read from the device."""
        num_logits = batch.num_logits if num_logits is None else num_logits
        order = None
        if self.lora is not None:  # requests by adapter slot: each layer's slot indices sorted
            order = SlotOrder(batch, num_logits)
            batch, num_logits = order.batch, order.num_logits
        pieces = self.pieces(batch)
        fills = self.fills(batch, inflight) if inflight is not None else None
        caches = self.kv.step_caches(batch.scheduled)
        if self.lora is None:
            return forward_pooled(self.model, self.head, pieces, caches, num_logits, batch.hidden_rows, fills)
        self.lora.set_step([r.lora_slot for r, _ in batch.scheduled], [n for _, n in batch.scheduled])
        try:
            return order.restore(*forward_pooled(self.model, self.head, pieces, caches, num_logits,
                                                 batch.hidden_rows, fills))
        finally:
            self.lora.set_step([], [])

    @staticmethod
    def pieces(batch: SchedulerOutput) -> list[list[int]]:
        """Each scheduled request's tokens of this step: its known tokens, then its drafts, or a 0
        where its placeholder goes (``fills``)."""
        pieces = []
        for r, n in batch.scheduled:
            known = r.token_ids[r.num_computed_tokens : r.num_computed_tokens + n]
            if len(known) < n:
                known = known + (batch.drafts[r][: n - len(known)] if r in batch.drafts else [0])
            pieces.append(known)
        return pieces

    @staticmethod
    def fills(batch: SchedulerOutput, inflight) -> tuple[list[int], mx.array] | None:
        """(packed positions, tokens) of the step's placeholders: each the last token of its
        request's piece, read on the device from the step in flight that sampled it."""
        at, rows, offset = [], [], 0
        for r, n in batch.scheduled:
            offset += n
            if r.num_computed_tokens + n > r.num_tokens and r not in batch.drafts:
                at.append(offset - 1)
                rows.append(inflight.row_of(r))
        return (at, inflight.tokens[mx.array(rows)]) if at else None
