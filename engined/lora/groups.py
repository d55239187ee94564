"""The projections of one layer that read one input (q/k/v, gate/up), run as one linear and one adapter term.

A layer's q_proj, k_proj and v_proj are called on the same array, as are its
MLP's gate_proj and up_proj. A group joins its members' base weights into
one linear (``runner.JoinedLinears``) and their adapters into one term of
``n * R`` columns per slot: A ``[in, S * n * R]``, slot ``s``'s columns
``(s-1)*n*R`` onwards, member ``i``'s ``R`` of them at ``i*R``; B ``[S * n *
R, out_1 + .. + out_n]``, block-diagonal (member ``i``'s rows reach only its
own outputs). The group's whole output, base plus every row's term, is then

    y = addmm(base(x), (x @ A) * mask, B)

four operations however many members, three where the base is plain (not
quantized) and of the slots' dtype: then A's columns are its weight's last
output rows (``folded``) and its one matmul gives ``z = [y | x @ A]``, and B
has as many zero columns more, so that ``addmm`` adds the term to the whole
of ``z``: a slice of it as addmm's addend would be copied first (MLX's
``AddMM`` wants a row-contiguous addend), one kernel more. Separate
projections took ``2 + 2n`` (7 for q/k/v with the A product already shared),
and a decode step on a GPU is bound by the host's cost per operation
(bench/lora_results.md). Where attention runs on CUDA, a step of at most
``lora_term.MAX_ROWS`` rows adds the term in one kernel instead of the mask
and ``addmm`` (``engined/kernels/lora_term.py``: MLX's CUDA ``addmm`` asks
cuBLASLt for an algorithm at every call), so a folded group is two launches.
A gate/up group called for its MLP's hidden state (``joined(glu=True)``,
``layers.SwiGLUMLP``) returns ``swiglu(gate, up)``, and that kernel applies
the activation as well: the MLP's own activation launch is saved. A group of
one whose output the decoder block adds to its input (o_proj, down_proj) is
given that input (``residual``, ``layers.ResidualBlock``) and adds it, in the
kernel where it runs: the block's addition is saved.
The price is B's zero blocks: ``n`` times the memory and arithmetic of the
members' B products, which are rank-sized against the base's. A projection
of an input of its own (o_proj, down_proj), or members that cannot be joined
(``fuse_linears``: mixed kinds or widths), are groups of one.

The output is made at the first member's call and kept for the others
(``JoinedLinears``); a step's ``LoraStep.set`` drops what a member never
called left. A group that no resident adapter targets runs its base alone.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

from mlxd.engined.runner import JoinedLinears, dims
from mlxd.engined.kernels import lora_term


class ProjectionGroup(JoinedLinears):
    """One input's projections: ``base`` (their joined linear), ``a`` and ``b`` (the slots' adapter columns,
    laid out as the module's docstring says; ``a`` None where they are ``base``'s last output rows:
    ``folded``), ``live`` (per member, the slots whose adapter targets it)."""

    def __init__(self, step, base: nn.Module, outs: list[int], num_adapters: int, rank: int, dtype: mx.Dtype):
        super().__init__(base, outs)
        self.step = step
        self.rank = rank
        self.width = len(outs) * rank  # one slot's columns
        columns, d_in = num_adapters * self.width, dims(base)[0]
        # A plain base of the slots' dtype takes A's columns as extra output rows, so that its one matmul
        # also gives x·A: one operation fewer per group in a step bound by the host's cost per operation.
        # A quantized base cannot (its rows are packed), nor one of another dtype.
        self.folded = type(base) is nn.Linear and base.weight.dtype == dtype
        self.a = None if self.folded else mx.zeros((d_in, columns), dtype)
        if self.folded:
            base.weight = mx.concatenate([base.weight, mx.zeros((columns, d_in), dtype)])
            if "bias" in base:
                base.bias = mx.concatenate([base.bias, mx.zeros((columns,), base.bias.dtype)])
        # A folded group's B reaches its x·A columns too, with zeros: see the module's docstring.
        self.b = mx.zeros((columns, self.offsets[-1] + (columns if self.folded else 0)), dtype)
        self.nbytes = columns * d_in * dtype.size + self.b.nbytes  # the slots' A and B
        # Whether the term kernel takes this group's widths (its members' outputs, its first member's, its base
        # output, B's rows).
        self.kernel_fits = lora_term.fits(self.offsets[-1], self.offsets[1], dims(base)[1], self.b.shape[1])
        self.live: list[set[int]] = [set() for _ in outs]
        # What the block adds this group's output to (``[tokens, out]``), set by ``layers.ResidualBlock`` just
        # before the branch that ends in this group runs, taken by the call: the sum is then this group's.
        self.residual: mx.array | None = None
        step.inputs.append(self)

    def arrays(self) -> list[mx.array]:
        """The arrays the slots are written into."""
        return [self.base.weight if self.folded else self.a, self.b]

    def write(self, member: int, slot: int, a: np.ndarray, b: np.ndarray, live: bool) -> None:
        """Member ``member``'s adapter ``a`` ``[in, R]``, ``b`` ``[R, out]`` in ``slot``."""
        start = (slot - 1) * self.width + member * self.rank
        rows, cols = slice(start, start + self.rank), slice(self.offsets[member], self.offsets[member + 1])
        if self.folded:
            out = self.offsets[-1]
            self.base.weight[out + start:out + start + self.rank] = mx.array(a.T).astype(self.b.dtype)
        else:
            self.a[:, rows] = mx.array(a).astype(self.a.dtype)
        self.b[rows, cols] = mx.array(b).astype(self.b.dtype)
        (self.live[member].add if live else self.live[member].discard)(slot)

    def joined(self, x: mx.array, glu: bool = False) -> mx.array:
        """The base projections plus each row's adapter term (``x`` is 2-D); a folded group's ``x·A`` columns
        follow where MLX's operations add the term (``JoinedLinears.output`` cuts them off). With ``glu`` (a
        gate/up group) ``swiglu(gate, up)`` of the two instead, the MLP's hidden state; with a ``residual`` set,
        that plus the output. Where the term kernel runs, either is in its one launch."""
        residual, self.residual = self.residual, None
        y = self.base(x)
        step, out = self.step, self.offsets[-1]
        if step.slots is not None and any(self.live):
            h = y if self.folded else mx.matmul(x.astype(self.a.dtype), self.a)
            if (step.term_kernel and y.shape[0] <= lora_term.MAX_ROWS and y.dtype == h.dtype == self.b.dtype
                    and self.kernel_fits and (residual is None or residual.dtype == y.dtype)):
                return lora_term.add_term(y, h, out if self.folded else 0, self.b, step.slots, self.width,
                                          self.offsets[1] if glu else out, glu, residual)
            y = mx.addmm(y, (y[..., out:] if self.folded else h) * step.mask(self.width), self.b)
        if glu:
            return swiglu(y[:, :self.offsets[1]], y[:, self.offsets[1]:out])
        if residual is None:
            return y
        return residual + (y if y.shape[-1] == out else y[:, :out])
