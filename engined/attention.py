"""The one change mlxd makes to an mlx_lm model: its attention modules read the paged KV.

Each attention module is swapped for a ``PagedAttention`` that keeps the
original projections, norms and RoPE, writes this step's K/V into the paged
cache by ``slot_mapping`` and calls ``kernels.paged_attention`` over the packed
batch. Everything token-wise (embeddings, norms, MLP, MoE, head) runs unchanged
on the packed ``[1, T, hidden]`` activations.

Per-step data arrives as mlx_lm's own ``cache`` argument: the runner passes
the model one step object per layer (``engined.kv``: this step's metadata and
that layer's arrays), which mlx_lm hands to each layer's attention. What
differs between families is read once from each layer (``model_layers``).
Hybrid models' linear-attention layers are wrapped to run on per-request
state slots (``linear_attention``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

import kernels
from engined.linear_attention import SlottedLinearAttention
from engined.model_layers import LayerSettings, LayerSpec, transformer_layers
from shared.errors import ModelLoadError


class PagedAttention(nn.Module):
    def __init__(self, inner: nn.Module, settings: LayerSettings, backend: str = "auto"):
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
        # Which kernels.paged_attention implementation runs (EngineConfig.attention_backend, resolved).
        self.backend = backend

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        """``cache``: this layer's ``engined.kv.paged.PagedLayerStep`` (metadata, K/V arrays)."""
        if cache is None:
            raise RuntimeError("a paged attention layer ran without its step: run the model through "
                               "engined.runner.ModelRunner")
        s, meta = self.settings, cache.meta
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
        kc, vc = cache.write(k, v)
        out = kernels.paged_attention(
            q, kc, vc, meta, s.scale, sliding_window=s.sliding_window, softcap=s.softcap,
            sinks=self.sinks if "sinks" in self else None, backend=self.backend,
        )
        out = out.reshape(1, t, -1)
        if s.output_gate:
            out = out * mx.sigmoid(gate.reshape(1, t, -1))
        return self.o_proj(out)


class LastTokenNorm(nn.Module):
    """The final norm, applied only to the rows whose logits are sampled (saves the LM head's work).

    The norm takes no ``cache`` argument, so the runner sets ``rows`` for the
    forward it is about to run and clears it after.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.rows: mx.array | None = None
        # Rows whose normed hidden state is itself the result (embed requests' last tokens):
        # kept aside in ``hidden`` and never sent through the LM head.
        self.hidden_rows: mx.array | None = None
        self.hidden: mx.array | None = None

    def __call__(self, h: mx.array) -> mx.array:
        if self.hidden_rows is not None:
            self.hidden = self.inner(h[:, self.hidden_rows])
        return self.inner(h[:, self.rows])


def install(model: nn.Module, specs: list[LayerSpec], backend: str = "auto") -> LastTokenNorm:
    """Swap every attention for a PagedAttention and every linear layer for its slotted form.

    ``specs`` are ``model_layers.read_layers(model)``; returns the wrapped final norm.
    """
    layers = transformer_layers(model)
    for spec, layer in zip(specs, layers):
        if spec.linear is not None:
            layer.linear_attn = SlottedLinearAttention(spec.linear)
        else:
            layer.self_attn = PagedAttention(layer.self_attn, spec.settings, backend)
    inner_model = model.model
    norm = getattr(inner_model, "norm", None)
    if norm is None:
        raise ModelLoadError(f"{type(model).__module__}: no final norm found")
    inner_model.norm = LastTokenNorm(norm)
    return inner_model.norm
