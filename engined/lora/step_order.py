"""A packed step's requests ordered by adapter slot, so that every layer's per-token slot indices are sorted.

MLX's ``gather_mm`` takes a grouped GEMM (one product per adapter) when its
right-hand indices are sorted (``sorted_indices=True``: CUTLASS's grouped GEMM
on CUDA, the batched-RHS kernel on Metal); unsorted indices run one small
product per row. Ordering whole requests, not rows, keeps each request's rows
contiguous as the paged attention needs them: one permutation per step for all
layers, undone on the step's logits and hidden states.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engined.scheduler import SchedulerOutput


class SlotOrder:
    """``batch`` reordered by slot (stable), ``num_logits`` alike, and ``restore`` for the outputs' rows."""

    def __init__(self, batch: SchedulerOutput, num_logits: list[int]):
        slots = [r.lora_slot for r, _ in batch.scheduled]
        self.order = np.argsort(np.asarray(slots, np.int64), kind="stable")
        self.identity = bool((self.order == np.arange(len(slots))).all())
        if self.identity:
            self.batch, self.num_logits = batch, num_logits
            return
        self.batch = SchedulerOutput(scheduled=[batch.scheduled[i] for i in self.order], drafts=batch.drafts)
        self.num_logits = [num_logits[i] for i in self.order]
        self._logit_rows = self._inverse(num_logits)
        self._hidden_rows = self._inverse(batch.hidden_rows)

    def _inverse(self, counts: list[int]) -> mx.array | None:
        """Where each original request's rows (``counts[b]`` of them) sit in the reordered output."""
        if not any(counts):
            return None
        permuted = [counts[i] for i in self.order]
        starts = np.concatenate([[0], np.cumsum(permuted)[:-1]]).astype(np.int64)
        start_of = np.empty(len(counts), np.int64)
        start_of[self.order] = starts
        rows = [np.arange(start_of[b], start_of[b] + k) for b, k in enumerate(counts) if k]
        return mx.array(np.concatenate(rows).astype(np.int32))

    def restore(self, logits: mx.array, hidden: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """The reordered step's outputs back in the batch's own order."""
        if self.identity:
            return logits, hidden
        if self._logit_rows is not None:
            logits = logits[self._logit_rows]
        if hidden is not None and self._hidden_rows is not None:
            hidden = hidden[self._hidden_rows]
        return logits, hidden
