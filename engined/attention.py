"""The one change mlxd makes to an mlx_lm model: its attention modules read the paged KV.

Each attention module is swapped for a ``PagedAttention`` that keeps the
original projections, norms and RoPE, writes this step's K/V into the paged
cache by ``slot_mapping`` and calls ``kernels.paged_attention`` over the packed
batch. Everything token-wise (embeddings, norms, MLP, MoE, head) runs unchanged
on the packed ``[1, T, hidden]`` activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

import kernels
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


class PagedAttention(nn.Module):
    def __init__(self, inner: nn.Module, layer: int, ctx: StepContext, sliding_window: int | None):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            inner.q_proj, inner.k_proj, inner.v_proj, inner.o_proj,
        )
        # Per-head norms of Qwen3-style attention; absent elsewhere.
        if "q_norm" in inner:
            self.q_norm, self.k_norm = inner.q_norm, inner.k_norm
        self.rope = inner.rope
        self.n_heads, self.n_kv_heads, self.scale = inner.n_heads, inner.n_kv_heads, inner.scale
        self.softcap = getattr(inner, "attn_logit_softcapping", None)
        self.sliding_window = sliding_window
        self._layer = layer
        self._ctx = ctx

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        ctx, layer = self._ctx, self._layer
        meta = ctx.meta
        _, t, _ = x.shape
        q = self.q_proj(x).reshape(t, self.n_heads, -1)
        k = self.k_proj(x).reshape(t, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(t, self.n_kv_heads, -1)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        # Each token is its own "batch" row so RoPE takes a per-token offset.
        q = self.rope(q[:, :, None, :], offset=meta.positions)[:, :, 0, :]
        k = self.rope(k[:, :, None, :], offset=meta.positions)[:, :, 0, :]
        kc, vc = kernels.write_kv(ctx.k_caches[layer], ctx.v_caches[layer], k, v, meta.slot_mapping)
        ctx.k_caches[layer], ctx.v_caches[layer] = kc, vc
        out = kernels.paged_attention(
            q, kc, vc, meta, self.scale, sliding_window=self.sliding_window, softcap=self.softcap
        )
        return self.o_proj(out.reshape(1, t, -1))


class LastTokenNorm(nn.Module):
    """The final norm, applied only to the rows whose logits are sampled (saves the LM head's work)."""

    def __init__(self, inner: nn.Module, ctx: StepContext):
        super().__init__()
        self.inner = inner
        self._ctx = ctx

    def __call__(self, h: mx.array) -> mx.array:
        return self.inner(h[:, self._ctx.logit_rows])


_REQUIRED = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")


def install(model: nn.Module, ctx: StepContext) -> list[PagedAttention]:
    """Swap every layer's attention for a PagedAttention bound to ``ctx``; returns them in layer order."""
    inner_model = getattr(model, "model", None)
    layers = getattr(inner_model, "layers", None) or getattr(model, "layers", None)
    if not layers:
        raise ModelLoadError(f"{type(model).__module__}: no transformer layers found")
    window = getattr(inner_model, "sliding_window", None)
    swapped = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        missing = [a for a in _REQUIRED if attn is None or not hasattr(attn, a)]
        if missing:
            raise ModelLoadError(
                f"{type(model).__module__} layer {i}: attention lacks {', '.join(missing)}; "
                "this architecture is not supported by the paged runner yet"
            )
        paged = PagedAttention(attn, i, ctx, window if getattr(layer, "use_sliding", False) else None)
        layer.self_attn = paged
        swapped.append(paged)
    norm = getattr(inner_model, "norm", None)
    if norm is None:
        raise ModelLoadError(f"{type(model).__module__}: no final norm found")
    inner_model.norm = LastTokenNorm(norm, ctx)
    return swapped
