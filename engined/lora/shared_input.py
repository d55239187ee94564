"""The x·A product of the projections that read one input (q/k/v, gate/up), computed once per input.

A layer's q_proj, k_proj and v_proj are called on the same array, as are its
MLP's gate_proj and up_proj. Their adapters' A matrices are stacked per slot
into one ``[slots, in, n * R]`` array (member ``i``'s columns ``i*R:(i+1)*R``),
so that one ``gather_mm`` gives every member's ``x·A`` and each member applies
only its own B to its slice: 4 ``gather_mm`` for q/k/v where 6 ran, 3 for
gate/up where 4 ran, and ``x`` is read once. The product is laid out once as
``[n, rows, R]`` so that every member's slice is contiguous: a strided slice as
``gather_mm``'s left operand is copied (MLX's CUDA ``check_transpose``), one
copy per member. A projection that reads an input of its own (o_proj,
down_proj) is a group of one.

Adapters that target only some members (PEFT's common ``q_proj, v_proj``) get
zero columns for the others: the shared product keeps one shape for every
slot, and a member that no resident adapter targets skips its B product
altogether (``SlottedLoraLinear.live_slots``), so the padding costs only the
zero columns' share of the one A product.
"""

from __future__ import annotations

import mlx.core as mx


class SharedInput:
    """One group's stacked A (``a``) and, while its members are being called, the product for one input.

    A member passes the array it was called with: the product is made from the
    first member's array and kept beside it; members called with that same array
    (mlx_lm's attention and MLP pass one ``x``) take their slices, and the last of
    the members that add a term drops it, so no layer's input is held past its
    layer. A member called with another array gets a product made from that one:
    right for any model, merely slower for one that feeds its projections apart.
    """

    def __init__(self, step, num_slots: int, input_dims: int, rank: int, count: int, dtype: mx.Dtype):
        self.step = step
        self.rank = rank
        self.a = mx.zeros((num_slots, input_dims, count * rank), dtype)
        self.members: list = []  # SlottedLoraLinear, in column order
        self._x: mx.array | None = None
        self._h: mx.array | None = None
        self._left = 0
        step.inputs.append(self)

    def clear(self) -> None:
        self._x = self._h = None
        self._left = 0

    def product(self, x: mx.array, column: int) -> mx.array:
        """``x·A`` of the step's adapted rows for the member of ``column``: ``[rows, 1, R]``."""
        if x is not self._x:
            step = self.step
            rows = x.reshape(-1, 1, x.shape[-1])
            if step.first:  # the base's rows, first in a sorted step, take no term
                rows = rows[step.first:]
            h = mx.gather_mm(rows.astype(self.a.dtype), self.a, rhs_indices=step.adapted,
                             sorted_indices=step.sorted)
            n = len(self.members)
            if n > 1:  # [n, rows, R]: each member's slice contiguous, as gather_mm's lhs must be (else copied)
                h = mx.contiguous(h.reshape(-1, n, self.rank).swapaxes(0, 1))
            self._h = h
            self._x = x
            self._left = sum(1 for m in self.members if m.live_slots)
        h = self._h
        self._left -= 1
        if self._left <= 0:
            self.clear()
        return h if len(self.members) == 1 else h[column].reshape(-1, 1, self.rank)
