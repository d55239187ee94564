"""What each layer of an mlx_lm model is, read from the layer itself: the one place family spellings are probed.

A layer is either attention (``self_attn``: heads, scale, sliding window,
soft cap, sinks, output gate) or a linear-attention layer of a hybrid model
(``linear_attn``: a recurrent state). Families spell the same setting
differently (``n_heads`` / ``num_attention_heads``, ``use_sliding`` /
``is_sliding`` / ``layer_types``); they are all tried here, never a table of
family names. A layer that cannot be read raises ``ModelLoadError``: a window
declared by the model that no layer claims, or a layer type mlxd does not know,
is refused rather than silently run as full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from shared.errors import ModelLoadError

_REQUIRED = ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


@dataclass(frozen=True)
class LayerSettings:
    """What the paged step needs to know about one layer's attention, read from the layer itself."""

    n_heads: int
    n_kv_heads: int
    scale: float
    head_dim: int = 0
    sliding_window: int | None = None  # keys at positions > pos - window are seen; None: all
    softcap: float | None = None  # tanh soft cap on the logits (Gemma 2 style)
    has_sinks: bool = False  # a learned per-head sink logit (gpt_oss)
    # q_proj also yields a per-head output gate (Qwen3-Next): [q | gate] per head, out * sigmoid(gate).
    output_gate: bool = False


@dataclass(frozen=True)
class LayerSpec:
    """Layer ``index`` of the model: attention (``settings``) or a linear layer (``linear``, its module)."""

    index: int
    settings: LayerSettings | None = None
    linear: nn.Module | None = None
    hidden_size: int = 0  # width of the hidden states a linear layer sees

    @property
    def sliding_window(self) -> int | None:
        return self.settings.sliding_window if self.settings else None


def _first(*pairs):
    """The first attribute that exists and is not None among ``(object, name)`` pairs, else None."""
    for obj, name in pairs:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def _where(model: nn.Module, i: int) -> str:
    return f"{type(model).__module__} layer {i}"


def _window(model: nn.Module, i: int, layer: nn.Module, attn: nn.Module) -> int | None:
    """The layer's sliding window, or None for full attention; refuses what it cannot tell apart."""
    inner = getattr(model, "model", model)
    args = getattr(model, "args", None)
    size = _first((inner, "window_size"), (inner, "sliding_window"), (args, "sliding_window"))
    sliding = _first((layer, "use_sliding"), (attn, "is_sliding"), (attn, "use_sliding_window"))
    if sliding is None:
        types = _first((inner, "layer_types"), (args, "layer_types"))
        if types is not None:
            if types[i] not in _LAYER_TYPES:
                raise ModelLoadError(f"{_where(model, i)}: attention of type {types[i]!r} is not supported "
                                     "by the paged runner yet")
            sliding = _LAYER_TYPES[types[i]]
        elif size is not None:
            raise ModelLoadError(f"{_where(model, i)}: the model declares a sliding window of {size} but no "
                                 "layer says whether it slides; this architecture is not supported yet")
    if not sliding:
        return None
    if size is None:
        raise ModelLoadError(f"{_where(model, i)}: sliding-window layer without a window size")
    return int(size)


def layer_settings(model: nn.Module, i: int, layer: nn.Module, attn: nn.Module) -> LayerSettings:
    """Read layer ``i``'s attention settings under the names mlx_lm's families use for them.

    Heads and scale come from the attention module (``n_heads``/``num_attention_heads``,
    ``scale``/``sm_scale``); whether the layer slides from the layer or its attention
    (``use_sliding``, ``is_sliding``, ``use_sliding_window``) or the model's
    ``layer_types``; the window size from the model body or its args.
    """
    missing = [a for a in _REQUIRED if attn is None or not hasattr(attn, a)]
    if missing:
        raise ModelLoadError(f"{_where(model, i)}: attention lacks {', '.join(missing)}; "
                             "this architecture is not supported by the paged runner yet")
    n_heads = _first((attn, "n_heads"), (attn, "num_attention_heads"))
    n_kv_heads = _first((attn, "n_kv_heads"), (attn, "num_key_value_heads"))
    scale = _first((attn, "scale"), (attn, "sm_scale"))
    missing = [n for n, v in (("heads", n_heads), ("kv heads", n_kv_heads), ("scale", scale)) if v is None]
    if missing:
        raise ModelLoadError(f"{_where(model, i)}: cannot read the attention's {', '.join(missing)}; "
                             "this architecture is not supported by the paged runner yet")
    window = _window(model, i, layer, attn)
    # Output widths are not packed by quantization: q_proj twice the heads' width carries a gate.
    q_width, k_width = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    head_dim = k_width // int(n_kv_heads)
    return LayerSettings(
        n_heads=int(n_heads), n_kv_heads=int(n_kv_heads), scale=float(scale), head_dim=head_dim,
        output_gate=q_width == 2 * int(n_heads) * head_dim,
        sliding_window=window,
        softcap=getattr(attn, "attn_logit_softcapping", None),
        has_sinks="sinks" in attn,
    )


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The layers this process runs: all of them, or one pipeline rank's run (``engined.pipeline``)."""
    inner = getattr(model, "model", None)
    layers = (getattr(inner, "pipeline_layers", None) or getattr(inner, "layers", None)
              or getattr(model, "layers", None))
    if not layers:
        raise ModelLoadError(f"{type(model).__module__}: no transformer layers found")
    return layers


def read_layers(model: nn.Module) -> list[LayerSpec]:
    """Every layer's spec, in layer order; ModelLoadError for a layer mlxd cannot run."""
    specs, hidden = [], None
    # A pipeline rank's first layer is the model's layer ``first``: settings read per layer
    # (layer_types) are indexed by the model's numbering, caches by this process's.
    first = getattr(getattr(model, "model", None), "start_idx", 0)
    for i, layer in enumerate(transformer_layers(model)):
        if "linear_attn" in layer:
            if hidden is None:
                # The width of the hidden states the linear layers see, whatever the embedding's storage.
                hidden = int(model.model.embed_tokens(mx.array([[0]])).shape[-1])
            specs.append(LayerSpec(i, linear=layer.linear_attn, hidden_size=hidden))
        else:
            specs.append(LayerSpec(i, settings=layer_settings(model, first + i, layer,
                                                              getattr(layer, "self_attn", None))))
    return specs


def float_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the model's floating-point weights (the K/V's dtype)."""
    return next((p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)),
                mx.float32)
