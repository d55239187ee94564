"""Dense linears whose weight's transpose is made once, not once per call.

``nn.Linear`` computes ``x @ weight.T`` (a tied LM head, ``nn.Embedding.as_linear``,
the same): every call adds a Transpose node to the step's graph, four per
decoder layer plus the LM head, and MLX encodes each node of a step on the
host (a GPU step is bound by that cost, ``bench/gpu_serving_results.md``).
The transpose is a view: made and
evaluated once, it is an array with the weight's memory and swapped strides,
which the matmul reads as it would read the node's output, so the result is
the same bit for bit and the step has one node fewer per linear.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


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
    (``linear_join.JoinedLinears.base``). Only for weights nothing writes into
    afterwards in place: LoRA's groups fold adapters into their bases' weights,
    so an engine with adapters does not call this.
    """
    modules = [m for _, m in model.named_modules() if type(m) in _HELD]
    for module in modules:
        module.__class__ = _HELD[type(module)]
        _held(module)
    return len(modules)
