"""A model's linears rewritten once, at install, so that a step's graph has fewer nodes.

A step on a GPU is bound by the host's cost per graph node (``bench/gpu_serving_results.md``), so:

- linears of one input run as one (``fuse_linears``, ``join_siblings``): one
  matmul where several ran, as vLLM's ``QKVParallelLinear`` and
  ``MergedColumnParallelLinear`` do. The paged attention joins its own q/k/v;
  an MLP's gate/up, called by mlx_lm's code one by one, become
  ``JoinedMember`` views of one ``JoinedLinears``, as the LoRA groups do for
  both (``engined/lora/groups.py``);
- a dense linear holds its weight's transpose (``hold_transposes``):
  ``nn.Linear`` computes ``x @ weight.T`` (a tied LM head,
  ``nn.Embedding.as_linear``, the same), a Transpose node per call, four per
  decoder layer plus the LM head. The transpose is a view: made and evaluated
  once, it is an array with the weight's memory and swapped strides, which the
  matmul reads as it would read the node's output, so the result is the same
  bit for bit.
"""

from __future__ import annotations

import copy
import itertools

import mlx.core as mx
import mlx.nn as nn


def dims(linear: nn.Module) -> tuple[int, int]:
    """(in, out) of a dense or quantized linear (quantized weights pack 32 // bits inputs per word)."""
    out, packed = linear.weight.shape[-2:]
    return (packed * 32 // linear.bits if "scales" in linear else packed), out


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear whose output is ``parts``' outputs side by side, or None where they cannot be one:
    not all plain ``nn.Linear`` (or all ``nn.QuantizedLinear`` of one bit width, group size and mode),
    a bias on some only, or different input widths.

    Built from the first part with its arrays replaced by the concatenations, evaluated here so the
    parts' arrays are freed as soon as nothing else holds them.
    """
    kind = type(parts[0])
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(p) is not kind for p in parts):
        return None
    settings = ("group_size", "bits", "mode") if kind is nn.QuantizedLinear else ()
    names = ("weight", "scales", "biases") if kind is nn.QuantizedLinear else ("weight",)
    if any(getattr(p, k, None) != getattr(parts[0], k, None) for p in parts for k in settings):
        return None
    if len({"bias" in p for p in parts}) > 1 or len({p.weight.shape[1] for p in parts}) > 1:
        return None
    fused = copy.copy(parts[0])
    for name in names + (("bias",) if "bias" in parts[0] else ()):
        setattr(fused, name, mx.concatenate([p[name] for p in parts], axis=0))
    mx.eval(fused.parameters())
    return fused


class JoinedLinears:
    """The joined ``base`` of members whose outputs are ``outs`` wide, in order.

    The output is made at the first member's call and kept beside the array it
    was made from; members called with that same array (mlx_lm's attention and
    MLP pass one ``x``) take their slices, and the last one drops it, so no
    layer's input is held past its layer. A member called with another array
    gets an output made from that one: right for any model, merely slower for
    one that feeds its projections apart.

    The outputs are 2-D, ``[tokens, out]``, whatever the input's leading axes (the packed step's
    ``[1, T, in]``): a matmul of a 3-D input flattens and unflattens it, two graph nodes, and what
    follows the members (an MLP's activation and down projection, then the residual add, which
    broadcasts) takes 2-D as well.
    """

    def __init__(self, base: nn.Module, outs: list[int]):
        self.base = base
        self.offsets = list(itertools.accumulate(outs, initial=0))
        self._x: mx.array | None = None
        self._held: list[mx.array] | None = None
        self._left = 0

    def clear(self) -> None:
        self._x = self._held = None
        self._left = 0

    def joined(self, x: mx.array) -> mx.array:
        """Every member's output for ``x``, side by side."""
        return self.base(x)

    def output(self, x: mx.array, member: int) -> mx.array:
        if x is not self._x:
            n = len(self.offsets) - 1
            y = self.joined(x if x.ndim == 2 else x.reshape(-1, x.shape[-1]))
            # A wider output has columns past the members' (a LoRA group's x·A): cut off and dropped.
            cuts = self.offsets[1:] if y.shape[-1] > self.offsets[-1] else self.offsets[1:-1]
            self._held = mx.split(y, cuts, axis=-1) if cuts else [y]
            self._x, self._left = x, n
        held = self._held[member]
        self._left -= 1
        if self._left <= 0:
            self.clear()
        return held


class JoinedMember(nn.Module):
    """One member of a ``JoinedLinears``, called as the linear it replaced; the first member holds the joined
    linear in the module tree (``linear``)."""

    def __init__(self, joined: JoinedLinears, member: int):
        super().__init__()
        self.joined = joined  # a plain object, outside the module tree (its members share it)
        self.member = member
        if member == 0:
            self.linear = joined.base

    def __call__(self, x: mx.array) -> mx.array:
        return self.joined.output(x, self.member)


def join_siblings(parent: nn.Module, names: tuple[str, ...]) -> bool:
    """Replace ``parent``'s linears ``names`` (all present, joinable by ``fuse_linears``) by views of one
    joined linear; whether it did."""
    if not all(name in parent for name in names):
        return False
    parts = [parent[name] for name in names]
    base = fuse_linears(parts)
    if base is None:
        return False
    joined = JoinedLinears(base, [dims(p)[1] for p in parts])
    for i, name in enumerate(names):
        setattr(parent, name, JoinedMember(joined, i))
    return True


def _held(module: nn.Module) -> mx.array:
    """``module``'s weight's transpose, evaluated, kept beside it outside the parameters (so the memory guard
    and the checkpoint's paths see the module as before). A weight assigned anew is seen by identity and
    its view made again."""
    weight = module["weight"]
    if module.__dict__.get("_of") is not weight:
        view = weight.T
        mx.eval(view)
        object.__setattr__(module, "_of", weight)
        object.__setattr__(module, "_view", view)
    return module._view


class TransposedLinear(nn.Linear):
    """An ``nn.Linear`` multiplying by its held transpose."""

    def __call__(self, x: mx.array) -> mx.array:
        view = _held(self)
        return mx.addmm(self["bias"], x, view) if "bias" in self else x @ view


class TransposedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose use as the tied LM head multiplies by its held transpose."""

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ _held(self)


_HELD = {nn.Linear: TransposedLinear, nn.Embedding: TransposedEmbedding}


def hold_transposes(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` and ``nn.Embedding`` of ``model`` hold its weight's transpose; how many.

    Each instance keeps its identity (its class changes): a joined linear's
    members call it through a reference outside the module tree
    (``JoinedLinears.base``). Only for weights nothing writes into
    afterwards in place: LoRA's groups fold adapters into their bases' weights,
    so an engine with adapters does not call this.
    """
    modules = [m for _, m in model.named_modules() if type(m) in _HELD]
    for module in modules:
        module.__class__ = _HELD[type(module)]
        _held(module)
    return len(modules)
