"""What each layer of an mlx_lm model is, read from the layer itself: the one place family spellings are probed.

A layer is either attention (``self_attn``: heads, scale, sliding window,
soft cap, sinks, output gate) or a linear-attention layer of a hybrid model
(``linear_attn``: a recurrent state). Families spell the same setting
differently (``n_heads`` / ``num_attention_heads`` / ``num_heads``,
``use_sliding`` / ``is_sliding`` / ``layer_types``, ``qkv_proj`` or three
projections); they are all tried here. A layer that cannot be read raises
``ModelLoadError``: a window declared by the model that no layer claims, or a
layer type mlxd does not know, is refused rather than silently run as full
attention.

Which ``model_type`` values may load at all is the one table of family names,
``SUPPORTED``: the families whose parity with mlx_lm the tests prove
(``tests/model_support.py``). ``check_model_type`` refuses any other from its
config alone, before a weight is read: an mlx_lm family whose attention mlxd
has not been shown to swap exactly is never run.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxd.shared.errors import ModelLoadError

_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}

# model_type -> the text model_types it may wrap (a vision-language checkpoint's text_config);
# () for a text model. Keep in step with tests/model_support.py's FAMILIES, which prove each.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "llama": (), "mistral": (), "smollm3": (), "qwen2": (), "qwen3": (), "qwen3_moe": (), "gpt_oss": (),
    "gemma2": (), "gemma3_text": (), "gemma3": ("gemma3_text",), "gemma4_text": (), "gemma4": ("gemma4_text",),
    "ministral3": (), "mistral3": ("mistral", "ministral3"), "mixtral": (), "phi3": (), "glm4": (),
    "glm4_moe": (), "olmo2": (), "qwen3_next": (), "qwen3_5": ("qwen3_5_text",),
    "qwen3_5_moe": ("qwen3_5_moe_text",), "idefics3": ("llama",), "qwen2_5_vl": (),
}


def check_model_type(config: dict) -> None:
    """Refuse, from config.json alone, a model whose family mlxd does not run; one line naming it.

    A wrapper (``text_config``) is refused too when the text model it wraps is not one it may.
    """
    model_type = config.get("model_type")
    supported = ", ".join(sorted(SUPPORTED))
    if model_type is None:
        raise ModelLoadError(f"config.json names no model_type; mlxd supports: {supported}")
    if model_type not in SUPPORTED:
        raise ModelLoadError(f"model_type {model_type!r} is not supported by mlxd; supported: {supported}")
    inner = (config.get("text_config") or {}).get("model_type")
    if inner is not None and inner not in SUPPORTED[model_type]:
        allowed = ", ".join(SUPPORTED[model_type]) or "none"
        raise ModelLoadError(f"model_type {model_type!r} wrapping text model_type {inner!r} is not supported "
                             f"by mlxd; it may wrap: {allowed}")


@dataclass(frozen=True)
class LayerSettings:
    """What the paged step needs to know about one layer's attention, read from the layer itself."""

    n_heads: int
    n_kv_heads: int
    scale: float
    head_dim: int = 0
    fused_qkv: bool = False  # one ``qkv_proj`` yields [q | k | v] (Phi-3)
    # q/k norms over the whole projection, all heads at once (OLMo 2), not per head (Qwen3, Gemma 3).
    qk_norm_whole: bool = False
    k_is_v: bool = False  # V is K's projection, before K's norm and RoPE (Gemma 4's global layers)
    # Llama 4's position-dependent query scale (Ministral 3): (beta, original context length).
    query_position_scale: tuple[float, int] | None = None
    # The attention returns (output, K/V, offset) for later layers that share them (Gemma 4).
    returns_kv: bool = False
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
    # The earlier layer whose K/V this attention layer reads instead of computing its own (Gemma 4):
    # both are served by one pool entry, written once by the source.
    kv_source: int | None = None

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


# The mlx_lm model modules whose body and decoder layers run as well on a 2-D ``[T, hidden]`` stream as on
# ``[1, T, hidden]`` (nothing in them reads the sequence axis): the runner feeds them 1-D tokens, which saves
# each layer the reshapes into and out of the packed batch and the residual add's broadcast. Each is proven
# by the family parity tests (``tests/engined/test_families.py``); Ministral 3, Gemma 4 and the hybrid
# families read the sequence axis and stay packed, as does GLM-4.5, whose MTP layer reads the packed hidden
# states (``engined/speculation/mtp.py``).
FLAT_STREAM = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma2", "gemma3_text", "mixtral",
                         "phi3", "glm4", "olmo2", "smollm3"})


def flat_stream(model: nn.Module) -> bool:
    """Whether ``model``'s family runs on a 2-D stream (``FLAT_STREAM``), read from its text model's module."""
    return type(text_model(model)).__module__.rpartition(".")[2] in FLAT_STREAM


def text_model(model: nn.Module) -> nn.Module:
    """The language model inside a vision-language wrapper (``language_model``), else the model itself.

    Its ``model`` is the decoder body (embeddings, layers, final norm) and its ``args`` the text config.
    """
    return getattr(model, "language_model", model)


def _window(model: nn.Module, i: int, layer: nn.Module, attn: nn.Module) -> int | None:
    """The layer's sliding window, or None for full attention; refuses what it cannot tell apart."""
    text = text_model(model)
    inner = getattr(text, "model", text)
    args = getattr(text, "args", None)
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


def _projections(model: nn.Module, i: int, attn: nn.Module, n_heads: int, n_kv_heads: int) -> tuple[int, int, bool]:
    """(q width, head_dim, fused) from the projections' output widths (not packed by quantization)."""
    if attn is not None and "qkv_proj" in attn:
        width = attn.qkv_proj.weight.shape[0]
        head_dim = width // (n_heads + 2 * n_kv_heads)
        return n_heads * head_dim, head_dim, True
    missing = [a for a in ("q_proj", "o_proj") if attn is None or a not in attn]
    if attn is not None and getattr(attn, "has_kv", True):  # a layer that shares K/V has no K/V projections
        missing += [a for a in ("k_proj", "v_proj")
                    if a not in attn and not (a == "v_proj" and getattr(attn, "use_k_eq_v", False))]
    if missing:
        raise ModelLoadError(f"{_where(model, i)}: attention lacks {', '.join(missing)}; "
                             "this architecture is not supported by the paged runner yet")
    head_dim = _first((attn, "head_dim"))
    if "k_proj" in attn:
        head_dim = attn.k_proj.weight.shape[0] // n_kv_heads
    if head_dim is None:
        raise ModelLoadError(f"{_where(model, i)}: cannot read the attention's head size; "
                             "this architecture is not supported by the paged runner yet")
    return attn.q_proj.weight.shape[0], int(head_dim), False


# Positions a RoPE is probed at: one packed call must rotate each row as a call at its own offset would.
_PROBE_POSITIONS = (0, 7, 4099)


def _check_rope(model: nn.Module, i: int, rope: nn.Module, head_dim: int) -> None:
    """Refuse a RoPE that cannot rotate packed tokens each by its own position.

    The paged step calls RoPE once for all tokens with per-token offsets; a RoPE
    whose rotation depends on the sequence as a whole (dynamic NTK scaling: its
    base follows the sequence length) either fails or would differ from mlx_lm.
    """
    n = len(_PROBE_POSITIONS)
    x = mx.sin(mx.arange(n * head_dim, dtype=mx.float32)).reshape(n, 1, 1, head_dim)
    try:
        packed = rope(x, offset=mx.array(_PROBE_POSITIONS))
        alone = mx.concatenate([rope(x[j : j + 1], offset=p) for j, p in enumerate(_PROBE_POSITIONS)])
        same = mx.allclose(packed, alone, rtol=1e-4, atol=1e-5).item()
    except (ValueError, TypeError, RuntimeError):
        same = False
    if not same:
        raise ModelLoadError(f"{_where(model, i)}: its RoPE ({type(rope).__name__}) cannot rotate each token of a "
                             "packed batch by its own position; this architecture is not supported by the "
                             "paged runner yet")


def layer_settings(model: nn.Module, i: int, layer: nn.Module, attn: nn.Module) -> LayerSettings:
    """Read layer ``i``'s attention settings under the names mlx_lm's families use for them.

    Heads and scale come from the attention module (``n_heads``/``num_attention_heads``/``num_heads``,
    ``scale``/``sm_scale``); whether the layer slides from the layer or its attention
    (``use_sliding``, ``is_sliding``, ``use_sliding_window``) or the model's
    ``layer_types``; the window size from the model body or its args.
    """
    if attn is None or "rope" not in attn:
        raise ModelLoadError(f"{_where(model, i)}: attention lacks rope; "
                             "this architecture is not supported by the paged runner yet")
    n_heads = _first((attn, "n_heads"), (attn, "num_attention_heads"), (attn, "num_heads"))
    n_kv_heads = _first((attn, "n_kv_heads"), (attn, "num_key_value_heads"))
    scale = _first((attn, "scale"), (attn, "sm_scale"))
    missing = [n for n, v in (("heads", n_heads), ("kv heads", n_kv_heads), ("scale", scale)) if v is None]
    if missing:
        raise ModelLoadError(f"{_where(model, i)}: cannot read the attention's {', '.join(missing)}; "
                             "this architecture is not supported by the paged runner yet")
    n_heads, n_kv_heads = int(n_heads), int(n_kv_heads)
    window = _window(model, i, layer, attn)
    q_width, head_dim, fused = _projections(model, i, attn, n_heads, n_kv_heads)
    _check_rope(model, i, attn.rope, head_dim)
    beta = getattr(attn, "scaling_beta", None)
    return LayerSettings(
        n_heads=n_heads, n_kv_heads=n_kv_heads, scale=float(scale), head_dim=head_dim,
        # q_proj twice the heads' width carries a per-head output gate.
        output_gate=q_width == 2 * n_heads * head_dim,
        sliding_window=window,
        softcap=getattr(attn, "attn_logit_softcapping", None),
        has_sinks="sinks" in attn,
        fused_qkv=fused,
        qk_norm_whole="q_norm" in attn and "weight" in attn.q_norm and attn.q_norm.weight.shape[0] != head_dim,
        k_is_v=bool(getattr(attn, "use_k_eq_v", False)),
        query_position_scale=None if beta is None else (float(beta), int(attn.original_max_position_embeddings)),
        returns_kv=hasattr(attn, "has_kv"),
    )


def _kv_source(model: nn.Module, i: int, attn: nn.Module) -> int | None:
    """The earlier layer whose K/V layer ``i`` reads (Gemma 4's ``previous_kvs``), or None: its own."""
    if getattr(attn, "has_kv", True):
        return None
    body = text_model(model).model
    sources = getattr(body, "previous_kvs", None)
    if sources is None or sources[i] >= i:
        raise ModelLoadError(f"{_where(model, i)}: the layer shares K/V but no earlier layer is named as "
                             "their source; this architecture is not supported yet")
    return int(sources[i])


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The layers this process runs: all of them, or one pipeline rank's run (``engined.parallel.pipeline``)."""
    text = text_model(model)
    inner = getattr(text, "model", None)
    split = getattr(inner, "end_idx", None) is not None  # mlx_lm's pipeline() set it; its layers list has Nones
    layers = (getattr(inner, "pipeline_layers" if split else "layers", None) or getattr(inner, "layers", None)
              or getattr(model, "layers", None))
    if not layers:
        raise ModelLoadError(f"{type(model).__module__}: no transformer layers found")
    return layers


def read_layers(model: nn.Module) -> list[LayerSpec]:
    """Every layer's spec, in layer order; ModelLoadError for a layer mlxd cannot run."""
    specs, hidden = [], None
    # A pipeline rank's first layer is the model's layer ``first``: settings read per layer
    # (layer_types) are indexed by the model's numbering, caches by this process's.
    first = getattr(getattr(text_model(model), "model", None), "start_idx", 0)
    for i, layer in enumerate(transformer_layers(model)):
        if "linear_attn" in layer:
            if hidden is None:
                # The width of the hidden states the linear layers see, whatever the embedding's storage.
                hidden = int(text_model(model).model.embed_tokens(mx.array([[0]])).shape[-1])
            specs.append(LayerSpec(i, linear=layer.linear_attn, hidden_size=hidden))
            continue
        attn = getattr(layer, "self_attn", None)
        spec = LayerSpec(i, settings=layer_settings(model, first + i, layer, attn),
                         kv_source=_kv_source(model, i, attn))
        if spec.kv_source is not None:
            source = specs[spec.kv_source]
            mine, theirs = spec.settings, source.settings
            if theirs is None or (mine.n_kv_heads, mine.head_dim, mine.sliding_window) != (
                    theirs.n_kv_heads, theirs.head_dim, theirs.sliding_window):
                raise ModelLoadError(f"{_where(model, i)}: shares layer {spec.kv_source}'s K/V but not their "
                                     "shape or window; this architecture is not supported yet")
        specs.append(spec)
    return specs


def float_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the model's floating-point weights (the K/V's dtype)."""
    return next((p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)),
                mx.float32)
