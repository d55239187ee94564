"""Linears of one input as one linear: one matmul where several ran (q/k/v, gate/up).

A step on a GPU is bound by the host's cost per launched operation, so
joining projections that read the same array saves whole operations per
layer, as vLLM's ``QKVParallelLinear`` does. Used by the paged attention and
by the LoRA groups (``engined/lora/groups.py``).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn


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
