"""The one change mlxd makes to an mlx_lm model: its attention modules read the paged KV.

Each attention module is swapped for a ``PagedAttention`` that keeps the
original projections, norms and RoPE, writes this step's K/V into the paged
cache by ``slot_mapping`` and calls ``kernels.paged_attention`` over the packed
batch. Everything token-wise (embeddings, norms, MLP, MoE, head) runs unchanged
on the packed ``[1, T, hidden]`` activations.

What differs between families is read from each layer's own module by
``layer_settings`` (heads, scale, sliding window, soft cap, sinks, output
gate), never from a table of family names. Hybrid models' linear-attention
layers are wrapped to run on per-request state slots (``linear_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

import kernels
from engined.linear_attention import SlottedLinearAttention
from kernels import AttentionMetadata
from shared.errors import ModelLoadError


@dataclass
class StepContext:
    """What every layer reads during one forward: set by the runner once per step."""

    meta: AttentionMetadata | None = None
    # Per layer: K and V caches [num_blocks, block_size, H_kv, D]; replaced as they are written.
    k_caches: list[mx.array] = field(default_factory=list)
    v_caches: list[mx.array] = field(default_factory=list)
    # Rows of the packed batch whose logits are needed (each sampling request's last token).
    logit_rows: mx.array | None = None
    # Hybrid models: the linear-attention layers (in order), their state slots per layer
    # ([num_slots, ...] arrays, replaced as they are written), this step's plan of who runs with which slot.
    linear: list = field(default_factory=list)
    states: list[list[mx.array]] = field(default_factory=list)
    state_plan: object | None = None
    hidden_size: int = 0
    # The attention modules in KV order; with a separate window pool (engined.window_kv), the
    # window layers' metadata (their own block tables and slots) for this step.
    attention: list = field(default_factory=list)
    window_meta: AttentionMetadata | None = None
    # Which kernels.paged_attention implementation runs (EngineConfig.attention_backend, resolved).
    attention_backend: str = "auto"


@dataclass(frozen=True)
class LayerSettings:
    """What the paged step needs to know about one layer's attention, read from the layer itself."""

    n_heads: int
    n_kv_heads: int
    scale: float
    sliding_window: int | None = None  # keys at positions > pos - window are seen; None: all
    softcap: float | None = None  # tanh soft cap on the logits (Gemma 2 style)
    has_sinks: bool = False  # a learned per-head sink logit (gpt_oss)
    # q_proj also yields a per-head output gate (Qwen3-Next): [q | gate] per head, out * sigmoid(gate).
    output_gate: bool = False


class PagedAttention(nn.Module):
    def __init__(self, inner: nn.Module, layer: int, ctx: StepContext, settings: LayerSettings):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            inner.q_proj, inner.k_proj, inner.v_proj, inner.o_proj,
        )
        # Per-head norms of Qwen3/Gemma 3-style attention; absent elsewhere.
        if "q_norm" in inner:
            self.q_norm, self.k_norm = inner.q_norm, inner.k_norm
        if settings.has_sinks:
            self.sinks = inner.sinks  # same parameter path as the original module's
        self.rope = inner.rope
        self.settings = settings
        self._layer = layer
        self._ctx = ctx

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        ctx, layer, s = self._ctx, self._layer, self.settings
        meta = ctx.window_meta if s.sliding_window is not None and ctx.window_meta is not None else ctx.meta
        _, t, _ = x.shape
        q = self.q_proj(x).reshape(t, s.n_heads, -1)
        if s.output_gate:
            q, gate = mx.split(q, 2, axis=-1)
        k = self.k_proj(x).reshape(t, s.n_kv_heads, -1)
        v = self.v_proj(x).reshape(t, s.n_kv_heads, -1)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        # Each token is its own "batch" row so RoPE takes a per-token offset.
        q = self.rope(q[:, :, None, :], offset=meta.positions)[:, :, 0, :]
        k = self.rope(k[:, :, None, :], offset=meta.positions)[:, :, 0, :]
        kc, vc = kernels.write_kv(ctx.k_caches[layer], ctx.v_caches[layer], k, v, meta.slot_mapping)
        ctx.k_caches[layer], ctx.v_caches[layer] = kc, vc
        out = kernels.paged_attention(
            q, kc, vc, meta, s.scale, sliding_window=s.sliding_window, softcap=s.softcap,
            sinks=self.sinks if "sinks" in self else None, backend=ctx.attention_backend,
        )
        out = out.reshape(1, t, -1)
        if s.output_gate:
            out = out * mx.sigmoid(gate.reshape(1, t, -1))
        return self.o_proj(out)


class LastTokenNorm(nn.Module):
    """The final norm, applied only to the rows whose logits are sampled (saves the LM head's work)."""

    def __init__(self, inner: nn.Module, ctx: StepContext):
        super().__init__()
        self.inner = inner
        self._ctx = ctx

    def __call__(self, h: mx.array) -> mx.array:
        return self.inner(h[:, self._ctx.logit_rows])


_REQUIRED = ("q_proj", "k_proj", "v_proj", "o_proj", "rope")


def _first(*pairs):
    """The first attribute that exists and is not None among ``(object, name)`` pairs, else None."""
    for obj, name in pairs:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def layer_settings(model: nn.Module, i: int, layer: nn.Module, attn: nn.Module) -> LayerSettings:
    """Read layer ``i``'s attention settings under the names mlx_lm's families use for them.

    Heads and scale come from the attention module (``n_heads``/``num_attention_heads``,
    ``scale``/``sm_scale``); whether the layer slides from the layer or its attention
    (``use_sliding``, ``is_sliding``, ``use_sliding_window``) or the model's
    ``layer_types``; the window size from the model body or its args.
    """
    inner = getattr(model, "model", model)
    args = getattr(model, "args", None)
    n_heads = _first((attn, "n_heads"), (attn, "num_attention_heads"))
    n_kv_heads = _first((attn, "n_kv_heads"), (attn, "num_key_value_heads"))
    scale = _first((attn, "scale"), (attn, "sm_scale"))
    missing = [n for n, v in (("heads", n_heads), ("kv heads", n_kv_heads), ("scale", scale)) if v is None]
    if missing:
        raise ModelLoadError(
            f"{type(model).__module__} layer {i}: cannot read the attention's {', '.join(missing)}; "
            "this architecture is not supported by the paged runner yet"
        )
    sliding = _first((layer, "use_sliding"), (attn, "is_sliding"), (attn, "use_sliding_window"))
    if sliding is None:
        types = _first((inner, "layer_types"), (args, "layer_types"))
        sliding = types is not None and types[i] == "sliding_attention"
    window = None
    if sliding:
        window = _first((inner, "window_size"), (inner, "sliding_window"), (args, "sliding_window"))
        if window is None:
            raise ModelLoadError(f"{type(model).__module__} layer {i}: sliding-window layer without a window size")
    # Output widths are not packed by quantization: q_proj twice the heads' width carries a gate.
    q_width, k_width = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    head_dim = k_width // int(n_kv_heads)
    return LayerSettings(
        n_heads=int(n_heads), n_kv_heads=int(n_kv_heads), scale=float(scale),
        output_gate=q_width == 2 * int(n_heads) * head_dim,
        sliding_window=int(window) if window is not None else None,
        softcap=getattr(attn, "attn_logit_softcapping", None),
        has_sinks="sinks" in attn,
    )


def install(model: nn.Module, ctx: StepContext) -> list[PagedAttention]:
    """Swap every layer's attention for a PagedAttention bound to ``ctx``; returns them in layer order.

    Linear-attention layers of hybrid models (``linear_attn``) are wrapped to run on
    state slots instead (``engined.linear_attention``) and listed in ``ctx.linear``;
    only the attention layers get paged K/V, numbered in their own order.
    """
    inner_model = getattr(model, "model", None)
    layers = getattr(inner_model, "layers", None) or getattr(model, "layers", None)
    if not layers:
        raise ModelLoadError(f"{type(model).__module__}: no transformer layers found")
    swapped = []
    ctx.linear = []
    for i, layer in enumerate(layers):
        if "linear_attn" in layer:
            layer.linear_attn = SlottedLinearAttention(layer.linear_attn, len(ctx.linear), ctx)
            ctx.linear.append(layer.linear_attn)
            continue
        attn = getattr(layer, "self_attn", None)
        missing = [a for a in _REQUIRED if attn is None or not hasattr(attn, a)]
        if missing:
            raise ModelLoadError(
                f"{type(model).__module__} layer {i}: attention lacks {', '.join(missing)}; "
                "this architecture is not supported by the paged runner yet"
            )
        paged = PagedAttention(attn, len(swapped), ctx, layer_settings(model, i, layer, attn))
        layer.self_attn = paged
        swapped.append(paged)
    norm = getattr(inner_model, "norm", None)
    if norm is None:
        raise ModelLoadError(f"{type(model).__module__}: no final norm found")
    inner_model.norm = LastTokenNorm(norm, ctx)
    ctx.attention = swapped
    if ctx.linear:
        # The width of the hidden states the linear layers see, whatever the embedding's storage.
        ctx.hidden_size = int(inner_model.embed_tokens(mx.array([[0]])).shape[-1])
    return swapped
