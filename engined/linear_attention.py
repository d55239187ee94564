"""Linear-attention layers (gated delta nets of Qwen3-Next / Qwen3.5) in the packed step.

Such a layer carries a per-request state instead of a KV cache: mlx_lm keeps it
in an ``ArraysCache`` (a short convolution window and the recurrent matrix).
``SlottedLinearAttention`` keeps the layer's own module and runs it once per
group of the step's plan (all decode rows as one batch, each prefill piece on
its own), handing it an ``ArraysCache`` filled from the request's state slots
and writing what it leaves there back to the slots. The layer's arithmetic is
mlx_lm's, unchanged; only where its state lives differs, and, on a CUDA GPU,
which kernel runs its recurrence (``engined.kernels.gated_delta``: mlx_lm has one for
Metal only).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache


@dataclass(frozen=True)
class StateGroup:
    """Requests run through a linear layer together: ``batch`` sequences of ``length`` new tokens each."""

    rows: mx.array  # [batch * length] packed rows, request-major
    slots: mx.array  # [batch] state slot of each sequence
    batch: int
    length: int
    # After the group: state of sequence snap_src[i] is also copied to slot snap_dst[i] (prefix snapshots).
    snap_src: mx.array | None = None
    snap_dst: mx.array | None = None
    # Ragged sequences: each one's valid length ([batch]); the rows past it are padding, masked as
    # mlx_lm masks a batch's right padding (its state is the one after its last valid row).
    lengths: mx.array | None = None
    # Where each sequence's state goes afterwards, when not back to ``slots`` (a verification
    # window's copies, each cut at one of its positions: ``engined.kv.recurrent_state``).
    write_slots: mx.array | None = None


@dataclass(frozen=True)
class StatePlan:
    """The step's groups, in the order every linear layer runs them, and how to restore packed order."""

    groups: list[StateGroup]
    # packed row -> row of the concatenated group outputs (which may hold extra rows: a window's
    # cut copies); None if identical
    inverse: mx.array | None


class SlottedLinearAttention(nn.Module):
    def __init__(self, inner: nn.Module, recurrence=None):
        """``recurrence``: a function with mlx_lm's ``gated_delta_update`` signature that the layer runs
        in its place (``engined.kernels.gated_delta.recurrence``), or None for mlx_lm's own."""
        super().__init__()
        self.inner = inner
        self.recurrence = recurrence

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        """``cache``: this layer's ``engined.kv.recurrent_state.StateLayerStep`` (the plan, its slot arrays)."""
        if cache is None:
            raise RuntimeError("a linear-attention layer ran without state slots: run the model through "
                               "mlxd.engined.runner.ModelRunner")
        # The family's layer calls the update by its module-level name; the swap lasts while this layer
        # builds its graph (the engine builds one step at a time, on one thread).
        if self.recurrence is None:
            return self._run(x, cache)
        scope = type(self.inner).__call__.__globals__
        if "gated_delta_update" not in scope:
            return self._run(x, cache)
        own = scope["gated_delta_update"]
        scope["gated_delta_update"] = self.recurrence
        try:
            return self._run(x, cache)
        finally:
            scope["gated_delta_update"] = own

    def _run(self, x: mx.array, cache) -> mx.array:
        plan: StatePlan = cache.plan
        arrays = cache.arrays  # replaced element-wise as the groups write them
        hidden = x.shape[-1]
        outs = []
        for g in plan.groups:
            c = ArraysCache(len(arrays))
            for e, a in enumerate(arrays):
                c[e] = a[g.slots]
            mask = None
            if g.lengths is not None:
                c.lengths = mx.array(g.lengths)  # a copy: the layer's cache.advance decrements it in place
                mask = mx.arange(g.length)[None, :] < g.lengths[:, None]
            y = self.inner(x[0, g.rows].reshape(g.batch, g.length, hidden), mask, c)
            dst = g.slots if g.write_slots is None else g.write_slots
            for e in range(len(arrays)):
                arrays[e][dst] = c[e].astype(arrays[e].dtype)
                if g.snap_src is not None:
                    arrays[e][g.snap_dst] = c[e][g.snap_src].astype(arrays[e].dtype)
            outs.append(y.reshape(g.batch * g.length, hidden))
        out = mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
        if plan.inverse is not None:
            out = out[plan.inverse]
        return out[None]


def state_shapes(inner: nn.Module, hidden: int, dtype: mx.Dtype) -> list[tuple[tuple[int, ...], mx.Dtype]]:
    """Shape (without the batch axis) and dtype of each array the layer keeps in its cache.

    Found by running the layer once on two zero tokens: whatever the family
    stores, the slots store the same.
    """
    c = ArraysCache(8)
    mx.eval(inner(mx.zeros((1, 2, hidden), dtype=dtype), None, c))
    used = max((i + 1 for i, a in enumerate(c.cache) if a is not None), default=0)
    if not used or any(a is None for a in c.cache[:used]):
        raise ValueError("the linear-attention layer left no state, or gaps, in its cache")
    return [(tuple(a.shape[1:]), a.dtype) for a in c.cache[:used]]
