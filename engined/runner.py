"""Runs one packed step: the tokens and each layer's step object in, the sampled rows' logits out."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engined import attention
from engined.kv import KVCacheManager
from engined.lora.registry import LoraRegistry
from engined.model_layers import LayerSpec
from engined.scheduler import SchedulerOutput


def forward(model: nn.Module, head: attention.LastTokenNorm, pieces: list[list[int]], caches: list,
            num_logits: list[int]) -> mx.array:
    """Forward token ``pieces`` packed as one sequence; logits of each piece's last ``num_logits[b]`` rows.

    ``caches`` is the model's ``cache`` argument: one step object per layer.
    Returns ``[sum(num_logits), vocab]``, not yet evaluated.
    """
    lens = [len(p) for p in pieces]
    tokens = np.fromiter((t for piece in pieces for t in piece), dtype=np.int32, count=sum(lens))
    ends = np.cumsum(lens)
    rows = [np.arange(end - k, end) for end, k in zip(ends, num_logits) if k]
    head.rows = mx.array(np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32))
    try:
        return model(mx.array(tokens)[None], cache=caches)[0]
    finally:
        head.rows = None


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
        pieces = []
        for r, n in batch.scheduled:
            known = r.token_ids[r.num_computed_tokens : r.num_computed_tokens + n]
            pieces.append(known if len(known) == n else known + batch.drafts[r][: n - len(known)])
        caches = self.kv.step_caches(batch.scheduled)
        num_logits = batch.num_logits if num_logits is None else num_logits
        if self.lora is None:
            return forward(self.model, self.head, pieces, caches, num_logits)
        step = self.lora.step
        step.slots = self.lora.token_slots([r.lora_slot for r, _ in batch.scheduled], [n for _, n in batch.scheduled])
        try:
            return forward(self.model, self.head, pieces, caches, num_logits)
        finally:
            step.slots = None
