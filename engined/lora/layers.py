"""Linear layers that add each token's own adapter's low-rank term: many adapters in one packed step.

Every wrapped layer holds the resident adapters stacked by slot: ``lora_a``
``[slots, in, R]`` and ``lora_b`` ``[slots, R, out]`` (``R`` is
``--max-lora-rank``; smaller ranks are zero-padded, the scale is folded into
``b``). Slot 0 stays zero: the base model. The runner sets one per-token slot
index on the shared ``LoraStep`` before a forward, and each layer gathers its
tokens' A and B with ``mx.gather_mm`` (what vLLM's punica kernels do on
CUDA): one forward for the whole batch whatever its mix of adapters, the base
weights untouched. A step with no adapter skips the term.

Mixture-of-experts layers (mlx_lm's ``SwitchGLU``) hold one pair per slot
and expert, gathered by ``slot * experts + expert`` per routed row.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from engined.model_layers import transformer_layers


class LoraStep:
    """What the runner sets for one forward (``set``): ``slots``, each packed token's uint32 slot, or None.

    When the slots are sorted (the runner orders a step's requests by slot,
    ``step_order``) the base's rows come first and ``first`` is the first
    adapted row: a linear computes the term of rows ``first:`` only
    (``adapted``, their slots) with ``gather_mm``'s grouped path
    (``sorted_indices``), one product per adapter.
    """

    def __init__(self):
        self.slots: mx.array | None = None
        self.adapted: mx.array | None = None
        self.sorted = False
        self.first = 0

    def set(self, slots: np.ndarray) -> None:
        if not slots.any():
            self.slots = self.adapted = None
            self.sorted, self.first = False, 0
            return
        self.sorted = bool((slots[1:] >= slots[:-1]).all())
        self.first = int(np.argmax(slots > 0)) if self.sorted else 0
        self.slots = mx.array(slots)
        self.adapted = mx.array(slots[self.first:]) if self.first else self.slots


def lora_term(x: mx.array, a: mx.array, b: mx.array, index: mx.array, sorted_indices: bool = False
              ) -> mx.array:
    """``x @ a[index] @ b[index]`` per row, ``index`` broadcast against ``x``'s batch dims (in ``a``'s dtype)."""
    h = mx.gather_mm(x.astype(a.dtype), a, rhs_indices=index, sorted_indices=sorted_indices)
    return mx.gather_mm(h, b, rhs_indices=index, sorted_indices=sorted_indices)


def _dims(linear: nn.Module) -> tuple[int, int]:
    """(in, out) of a dense or quantized linear (quantized weights pack 32 // bits inputs per word)."""
    out, packed = linear.weight.shape[-2:]
    return (packed * 32 // linear.bits if "scales" in linear else packed), out


class SlottedLoraLinear(nn.Module):
    def __init__(self, linear: nn.Module, step: LoraStep, num_slots: int, rank: int, dtype: mx.Dtype):
        super().__init__()
        self.linear = linear
        self.step = step
        self.input_dims, self.output_dims = _dims(linear)
        self.lora_a = mx.zeros((num_slots, self.input_dims, rank), dtype)
        self.lora_b = mx.zeros((num_slots, rank, self.output_dims), dtype)

    def expected_shapes(self, rank: int) -> tuple[tuple, tuple]:
        return (self.input_dims, rank), (rank, self.output_dims)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        step = self.step
        if step.slots is None:
            return y
        rows = x.reshape(-1, 1, self.input_dims)
        if step.first:
            rows = rows[step.first:]
        z = lora_term(rows, self.lora_a, self.lora_b, step.adapted, step.sorted)
        z = z.reshape(-1, self.output_dims).astype(y.dtype)
        if step.first:  # the base's rows (first in a sorted step) add nothing
            z = mx.pad(z, [(step.first, 0), (0, 0)])
        return y + z.reshape(y.shape)


def _sort_rows(x: mx.array, indices: mx.array):
    """Routed rows sorted by expert, as mlx_lm's SwitchGLU sorts them, and each row's source token."""
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // k], flat[order], order // k, mx.argsort(order)


class SlottedLoraSwitchGLU(nn.Module):
    """mlx_lm's SwitchGLU (same projections, routing and sort) with per-token adapters on its three projections."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, inner: SwitchGLU, step: LoraStep, num_slots: int, rank: int, dtype: mx.Dtype):
        super().__init__()
        self.inner = inner
        self.step = step
        self.num_experts = inner.gate_proj.weight.shape[0]
        self.dims = {}
        for name in self.PROJECTIONS:
            d_in, d_out = _dims(getattr(inner, name))
            self.dims[name] = (d_in, d_out)
            n = num_slots * self.num_experts
            setattr(self, f"{name}_a", mx.zeros((n, d_in, rank), dtype))
            setattr(self, f"{name}_b", mx.zeros((n, rank, d_out), dtype))

    def expected_shapes(self, name: str, rank: int) -> tuple[tuple, tuple]:
        d_in, d_out = self.dims[name]
        return (self.num_experts, d_in, rank), (self.num_experts, rank, d_out)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        slots = self.step.slots
        if slots is None:
            return self.inner(x, indices)
        inner = self.inner
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= 64
        if do_sort:
            x, idx, token, inv = _sort_rows(x, indices)
            rows = slots[token] * self.num_experts + idx
        else:
            idx = indices
            rows = slots.reshape(indices.shape[:-1] + (1,)) * self.num_experts + idx

        def project(name, h):
            return getattr(inner, name)(h, idx, sorted_indices=do_sort) + lora_term(
                h, self[f"{name}_a"], self[f"{name}_b"], rows).astype(h.dtype)

        h = inner.activation(project("up_proj", x), project("gate_proj", x))
        out = project("down_proj", h)
        if do_sort:
            out = mx.unflatten(out[inv], 0, indices.shape)
        return out.squeeze(-2)


_LINEARS = (nn.Linear, nn.QuantizedLinear)


def install(model: nn.Module, num_slots: int, rank: int, dtype: mx.Dtype):
    """Wrap every linear and SwitchGLU of the transformer layers; returns the step and the targets.

    ``targets[path] = (wrapper, projection)``: paths are mlx_lm's from the model's
    root (``model.layers.0.self_attn.q_proj``), the names adapters use; a
    SwitchGLU's three projections (``...switch_mlp.gate_proj``) share its
    wrapper and name their ``projection``, a linear's is None. A SwitchGLU's
    projections are switch layers, not linears, so they are never wrapped twice. Linear-attention layers of hybrid models keep their
    own projections (their recurrent state is not adapted).
    """
    step = LoraStep()
    layers = transformer_layers(model)
    prefix = "model.layers" if getattr(getattr(model, "model", None), "layers", None) is layers else "layers"
    targets: dict[str, tuple[nn.Module, str | None]] = {}
    for i, layer in enumerate(layers):
        swaps = []
        for name, module in layer.named_modules():
            if name.startswith("linear_attn") or not name:
                continue
            if isinstance(module, SwitchGLU):
                wrapper = SlottedLoraSwitchGLU(module, step, num_slots, rank, dtype)
            elif isinstance(module, _LINEARS):
                wrapper = SlottedLoraLinear(module, step, num_slots, rank, dtype)
            else:
                continue
            swaps.append((name, wrapper))
        for name, wrapper in swaps:
            _set(layer, name, wrapper)
            if isinstance(wrapper, SlottedLoraSwitchGLU):
                for proj in SlottedLoraSwitchGLU.PROJECTIONS:
                    targets[f"{prefix}.{i}.{name}.{proj}"] = (wrapper, proj)
            else:
                targets[f"{prefix}.{i}.{name}"] = (wrapper, None)
    return step, targets


def _set(root: nn.Module, dotted: str, module: nn.Module) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        root = root[int(p)] if p.isdigit() else getattr(root, p)
    if last.isdigit():
        root[int(last)] = module
    else:
        setattr(root, last, module)
