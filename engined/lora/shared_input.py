"""The x·A product of the projections that read one input (q/k/v, gate/up), computed once per input.

A layer's q_proj, k_proj and v_proj are called on the same array, as are its
MLP's gate_proj and up_proj. Their adapters' A matrices sit side by side in
one ``[in, n * S * R]`` array (member ``i``'s columns ``i*S*R:(i+1)*S*R``, in
them slot ``s``'s ``(s-1)*R:s*R``), so that one matmul gives every member's
``x·A`` for every resident slot, and one multiply by the step's mask keeps
each row's own slot's columns: 2 operations for q/k/v where 6 would run
apart, and ``x`` is read once. The masked product is laid out ``[n, rows,
S * R]`` by that multiply, so each member's slice is contiguous, as a matmul's
left operand must be (MLX's CUDA ``check_transpose`` copies a strided one). A
projection that reads an input of its own (o_proj, down_proj) is a group of
one.

Adapters that target only some members (PEFT's common ``q_proj, v_proj``) get
zero columns for the others: the shared product keeps one shape for every
slot, and a member that no resident adapter targets skips its B product
altogether (``SlottedLoraLinear.live_slots``), so the padding costs only the
zero columns' share of the one A product.

On CUDA, in a decode-sized step (``LoraStep.kernel``), the group's members' whole outputs, base and
term, come from one ``kernels.lora`` launch made at the first member's call:
the others take theirs from it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels.lora import lora_outputs


class SharedInput:
    """One group's A columns (``a``) and, while its members are being called, what was made for one input
    (the masked product, or on the fused path every member's output).

    A member passes the array it was called with: the product is made from the
    first member's array and kept beside it; members called with that same array
    (mlx_lm's attention and MLP pass one ``x``) take their slices, and the last of
    the members that add a term drops it, so no layer's input is held past its
    layer. A member called with another array gets a product made from that one:
    right for any model, merely slower for one that feeds its projections apart.
    """

    def __init__(self, step, num_adapters: int, input_dims: int, rank: int, count: int, dtype: mx.Dtype):
        self.step = step
        self.rank = rank
        self.width = num_adapters * rank  # one member's columns
        self.a = mx.zeros((input_dims, count * self.width), dtype)
        self.members: list = []  # SlottedLoraLinear, in column order
        self._x: mx.array | None = None
        self._held: mx.array | None = None
        self._left = 0
        step.inputs.append(self)

    def clear(self) -> None:
        self._x = self._held = None
        self._left = 0

    def write(self, column: int, slot: int, a: np.ndarray) -> None:
        """Member ``column``'s A (``[in, R]``) for ``slot``."""
        start = column * self.width + (slot - 1) * self.rank
        self.a[:, start:start + self.rank] = mx.array(a).astype(self.a.dtype)

    def product(self, x: mx.array, column: int) -> mx.array:
        """``x·A`` of the member of ``column``, zero but each row's own slot's columns: ``[rows, S * R]``."""
        if x is not self._x:
            n = len(self.members)
            h = mx.matmul(x.reshape(-1, x.shape[-1]).astype(self.a.dtype), self.a)
            if n > 1:  # [n, rows, S * R]: the multiply writes each member's slice contiguous
                h = h.reshape(-1, n, self.width).swapaxes(0, 1)
            self._held = h * self.step.mask
            self._x = x
            self._left = sum(1 for m in self.members if m.live_slots)
        h = self._take()
        return h if len(self.members) == 1 else h[column]

    def fused(self, x: mx.array, column: int) -> mx.array:
        """Member ``column``'s output for ``x``, its base projection plus each row's term: every member's from
        one kernel launch, made when the first of them is called with ``x``."""
        members = self.members
        if x is not self._x:
            ys = [m.linear(x) for m in members]
            if any(m.live_slots for m in members):
                flat = [y.reshape(-1, y.shape[-1]) for y in ys]
                zs = lora_outputs(x.reshape(-1, x.shape[-1]), self.a, [m.lora_b for m in members], flat,
                                  self.step.slots, self.rank)
                ys = [z.reshape(y.shape) for z, y in zip(zs, ys)]
            self._held, self._x, self._left = ys, x, len(members)
        return self._take()[column]

    def _take(self):
        """What is held for this input, dropped once the last member that takes it has."""
        held = self._held
        self._left -= 1
        if self._left <= 0:
            self.clear()
        return held
