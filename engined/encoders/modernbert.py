"""ModernBERT encoders in MLX.

Pre-norm layers with rotary positions (no position table), bias-free projections and LayerNorms by
default, a gated GELU MLP (``Wi`` gives input and gate halves), and attention that alternates: every
``global_attn_every_n_layers``-th layer (from layer 0) attends globally with one rotary base, the
others see a window of ``local_attention // 2`` tokens either side with another. Layer 0 has no
attention norm (the embeddings' norm precedes it). Weights load by their Hugging Face names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxd.engined.encoders.bert import gelu_erf

MODEL_TYPES = ("modernbert",)

_ACTIVATIONS = {"gelu": gelu_erf, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx, "silu": nn.silu}


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_activation: str
    pad_token_id: int
    global_layers: tuple[bool, ...]
    global_rope_theta: float
    local_rope_theta: float
    local_attention: int

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        if self.hidden_activation not in _ACTIVATIONS:
            raise ValueError(f"hidden_activation {self.hidden_activation!r} is not supported")
        if len(self.global_layers) != self.num_hidden_layers:
            raise ValueError("layer_types does not name every layer")

    @classmethod
    def from_config(cls, config: dict) -> ModelArgs:
        n = config["num_hidden_layers"]
        if config.get("layer_types"):
            global_layers = tuple(t == "full_attention" for t in config["layer_types"])
        else:
            every = config.get("global_attn_every_n_layers", 3)
            global_layers = tuple(i % every == 0 for i in range(n))
        # Hub configs name the two rotary bases directly; newer transformers nest them per layer type.
        rope = config.get("rope_parameters") or {}
        global_theta = (rope.get("full_attention") or {}).get("rope_theta", config.get("global_rope_theta", 160_000.0))
        local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", config.get("local_rope_theta", 10_000.0))
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_hidden_layers=n,
            num_attention_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            norm_eps=config.get("norm_eps", 1e-5),
            norm_bias=config.get("norm_bias", False),
            attention_bias=config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False),
            hidden_activation=config.get("hidden_activation", "gelu"),
            pad_token_id=config.get("pad_token_id", 50283),
            global_layers=global_layers,
            global_rope_theta=float(global_theta),
            local_rope_theta=float(local_theta),
            local_attention=config.get("local_attention", 128),
        )

    @property
    def max_positions(self) -> int:
        """The longest sequence the model was trained for."""
        return self.max_position_embeddings


class _Attention(nn.Module):
    def __init__(self, args: ModelArgs, is_global: bool):
        super().__init__()
        h = args.hidden_size
        self.heads = args.num_attention_heads
        self.head_dim = h // self.heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.theta = args.global_rope_theta if is_global else args.local_rope_theta
        self.Wqkv = nn.Linear(h, 3 * h, bias=args.attention_bias)
        self.Wo = nn.Linear(h, h, bias=args.attention_bias)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, h = x.shape
        q, k, v = self.Wqkv(x).reshape(b, n, 3, self.heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        q = mx.fast.rope(q, self.head_dim, traditional=False, base=self.theta, scale=1.0, offset=0)
        k = mx.fast.rope(k, self.head_dim, traditional=False, base=self.theta, scale=1.0, offset=0)
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.Wo(a.transpose(0, 2, 1, 3).reshape(b, n, h))


class _Mlp(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.Wi = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.Wo = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.act = _ACTIVATIONS[args.hidden_activation]

    def __call__(self, x: mx.array) -> mx.array:
        inp, gate = mx.split(self.Wi(x), 2, axis=-1)
        return self.Wo(self.act(inp) * gate)


class _Layer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.is_global = args.global_layers[index]
        if index > 0:
            self.attn_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.attn = _Attention(args, self.is_global)
        self.mlp_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.mlp = _Mlp(args)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = x + self.attn(self.attn_norm(x) if "attn_norm" in self else x, mask)
        return x + self.mlp(self.mlp_norm(x))


class _Embeddings(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)

    def __call__(self, ids: mx.array) -> mx.array:
        return self.norm(self.tok_embeddings(ids))


class Model(nn.Module):
    """Token ids [B, L] (right-padded) and a key mask [B, L] -> last hidden states [B, L, hidden]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embeddings = _Embeddings(args)
        self.layers = [_Layer(args, i) for i in range(args.num_hidden_layers)]
        self.final_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        n = ids.shape[1]
        global_mask = mask[:, None, None, :]
        local_mask = global_mask
        half = self.args.local_attention // 2
        if n > half + 1:
            pos = mx.arange(n)
            local_mask = global_mask & (mx.abs(pos[:, None] - pos[None, :]) <= half)[None, None]
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x, global_mask if layer.is_global else local_mask)
        return self.final_norm(x)


def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """Hugging Face ModernBERT tensor names -> this module's; MLM/classifier heads dropped."""
    out = {}
    for name, w in weights.items():
        if name.startswith("model."):
            name = name[len("model."):]
        if name.startswith(("embeddings.", "layers.", "final_norm.")):
            out[name] = w
    return out
