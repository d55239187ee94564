"""GGUF architectures as mlx_lm models: the config from metadata, and tensor names and layouts.

llama.cpp's converter (convert_hf_to_gguf.py) renames Hugging Face tensors
and changes some layouts; each family here undoes exactly those changes so
that the weights land in mlx_lm's parameters as mlx_lm's own ``sanitize``
leaves them:

- llama/mistral: Q and K rows permuted for adjacent-pair RoPE.
- Gemma 3: every norm weight stored as ``1 + w`` (mlx_lm adds the 1 itself).
- Qwen3-Next / Qwen3.5: ``A_log`` stored as ``-exp(A_log)``; ``dt_bias`` as
  ``ssm_dt.bias``; the conv kernel squeezed to (channels, kernel). Qwen3-Next's
  fused ``in_proj_qkvz`` is split into ``attn_qkv`` + ``attn_gate`` with its
  per-key-head interleave undone; Qwen3.5 reorders its value heads from
  grouped-by-key-head to tiled when there are more value than key heads.
- gpt-oss: nothing beyond names (its gate/up split is what mlx_lm holds too).
- Gemma 4: nothing beyond names (fused expert gate/up is split, as for any
  family); its config is spread over per-layer arrays and a RoPE-frequency
  tensor (``gguf_gemma4``).

Qwen3-Next's and Qwen3.5's norms are already stored as ``1 + w``, which is
what mlx_lm holds for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mlxd.shared.errors import ModelLoadError

from .gguf_gemma4 import GEMMA4_GLOBALS, GEMMA4_LAYERS, GEMMA4_SCALES, gemma4_config
from .gguf_quant import Value, cat_rows, permute_cols, take_rows

_ATTN = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_SHARED_EXPERT = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_LINEAR_ATTN = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
}
_GPT_OSS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GEMMA3 = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BARE = ("sinks", "layer_scalar")
# ssm_a is stored without a suffix (as Mamba's is); it is read as a weight.
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias|scale))?$")


@dataclass(frozen=True)
class Family:
    model_type: str
    layers: dict[str, str]
    prefix: str = "model"  # where embed_tokens, layers and norm live
    head: str = "lm_head"
    # family-specific config: extra(get, shapes, read) with read(name) -> a tensor's float32 values
    extra: Callable[[Callable, dict, Callable], dict] = field(default=lambda get, shapes, read: {})
    globals: dict[str, str] = field(default_factory=dict)  # more non-layer tensors: GGUF name -> mlx_lm name
    permute_qk: bool = False
    norm_shift: float = 0.0
    per_layer_sizes: bool = False  # the family reads per-layer KV head counts / FFN sizes itself
    scales: dict[str, str] = field(default_factory=dict)  # "<part>.scale" tensors -> bare mlx_lm parameters


def _moe(get, tensors, read=None) -> dict:
    dense = [i for i in range(num_layers(get)) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    return {
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0)),
    }


def _linear_attention(get, tensors, read=None) -> dict:
    head_dim = int(get("attention.key_length"))
    v_heads = int(get("ssm.time_step_rank"))
    return {
        "linear_num_value_heads": v_heads,
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_value_head_dim": int(get("ssm.inner_size")) // v_heads,
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "full_attention_interval": int(get("full_attention_interval", 4)),
        "partial_rotary_factor": int(get("rope.dimension_count", head_dim)) / head_dim,
    }


def _qwen3_next(get, tensors, read=None) -> dict:
    return {**_moe(get, tensors), **_linear_attention(get, tensors)}


def _qwen35(get, tensors, moe: bool) -> dict:
    cfg = {**(_moe(get, tensors) if moe else {}), **_linear_attention(get, tensors)}
    cfg["rope_parameters"] = {
        "type": "default",
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": cfg.pop("partial_rotary_factor"),
    }
    cfg.pop("mlp_only_layers", None)
    return cfg


def _gemma3(get, tensors, read=None) -> dict:
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", 256))
    # llama.cpp scales queries by head_dim ** -0.5, except for the 27B (hidden / heads);
    # the GGUF file does not carry query_pre_attn_scalar.
    scalar = hidden / heads if (hidden, int(get("block_count"))) == (5376, 62) else head_dim
    if (scale := get("attention.scale")) is not None:
        scalar = 1.0 / float(scale) ** 2
    return {
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
        "sliding_window": int(get("attention.sliding_window", 512)),
        "sliding_window_pattern": int(get("attention.sliding_window_pattern", 6)),
    }


def _gpt_oss(get, tensors, read=None) -> dict:
    n_layers = num_layers(get)
    return {
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "intermediate_size": int(get("expert_feed_forward_length")),
        "sliding_window": int(get("attention.sliding_window", 128)),
        # llama.cpp's gpt-oss: even layers slide, odd layers are global.
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
    }


_QWEN = {**_ATTN, "ffn_norm": "post_attention_layernorm", **_MLP}
_HYBRID = {**_ATTN, "post_attention_norm": "post_attention_layernorm", **_MLP, **_LINEAR_ATTN}
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", _QWEN, permute_qk=True),
    "mistral": Family("llama", _QWEN, permute_qk=True),
    "qwen2": Family("qwen2", _QWEN),
    "qwen3": Family("qwen3", _QWEN),
    "qwen3moe": Family("qwen3_moe", {**_QWEN, **_MOE}, extra=_moe),
    "qwen3next": Family("qwen3_next", {**_HYBRID, **_MOE, **_SHARED_EXPERT}, extra=_qwen3_next),
    "qwen35": Family(
        "qwen3_5", _HYBRID, "language_model.model", "language_model.lm_head", lambda g, t, r: _qwen35(g, t, False)
    ),
    "qwen35moe": Family(
        "qwen3_5_moe",
        {**_HYBRID, **_MOE, **_SHARED_EXPERT},
        "language_model.model",
        "language_model.lm_head",
        lambda g, t, r: _qwen35(g, t, True),
    ),
    "gemma3": Family("gemma3_text", {**_ATTN, **_MLP, **_GEMMA3}, extra=_gemma3, norm_shift=1.0),
    "gpt-oss": Family("gpt_oss", {**_ATTN, **_GPT_OSS}, extra=_gpt_oss),
    "gemma4": Family(
        "gemma4_text",
        {**_ATTN, **_MLP, **_GEMMA3, **GEMMA4_LAYERS},
        extra=gemma4_config,
        globals=GEMMA4_GLOBALS,
        per_layer_sizes=True,
        scales=GEMMA4_SCALES,
    ),
}


def family_of(arch: str, path: str) -> Family:
    if arch not in FAMILIES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[arch]


def num_layers(get: Callable) -> int:
    """Decoder layers; llama.cpp counts multi-token-prediction blocks (mlx_lm has none) in block_count."""
    return int(get("block_count")) - int(get("nextn_predict_layers", 0) or 0)


def config_from_metadata(family: Family, get: Callable, tensors: dict[str, tuple], path: str, read: Callable) -> dict:
    """An HF-style config dict for the family's mlx_lm ModelArgs.

    ``get(key, default)`` reads ``<arch>.<key>`` from the metadata; ``tensors``
    maps the file's tensor names to their shapes (numpy order); ``read(name)``
    gives a tensor's values (for configuration stored as tensors).
    """
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    ffn = get("feed_forward_length", 0)
    if hasattr(kv_heads, "__len__") or hasattr(ffn, "__len__"):
        if not family.per_layer_sizes:
            raise ModelLoadError(f"{path}: per-layer KV head counts or FFN sizes are not supported for {family.model_type}")
        kv_heads = kv_heads[0] if hasattr(kv_heads, "__len__") else kv_heads
        ffn = ffn[0] if hasattr(ffn, "__len__") else ffn
    vocab = tensors["token_embd.weight"][0]
    config = {
        "model_type": family.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": num_layers(get),
        "intermediate_size": int(ffn),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }
    if (softcap := get("final_logit_softcapping")) is not None:
        config["final_logit_softcapping"] = float(softcap)
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor"))}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not supported for GGUF files")
    if "rope_freqs.weight" in tensors and family.permute_qk:
        # Llama 3.x stores its RoPE frequency factors as a tensor; the llama3 rope
        # class is built neutral and its frequencies replaced by the file's.
        config["rope_scaling"] = {"type": "llama3", "factor": 1.0}
    config.update(family.extra(get, tensors, read))
    return config


def _unpermute_qk(v: Value, n_heads: int) -> Value:
    """Undo llama.cpp's Q/K row order: per head, rows (pair, half) -> (half, pair)."""
    rows = v.shape[-2] if len(v.shape) > 1 else v.shape[0]
    order = np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)
    return take_rows(v, order)


def _untile(n: int, k_heads: int, per_k: int, width: int) -> np.ndarray:
    """Index order that turns llama.cpp's tiled value heads back into HF's grouped-by-key-head order."""
    tiled = np.arange(n).reshape(per_k, k_heads, width)
    return tiled.transpose(1, 0, 2).reshape(-1)


def _qkvz_order(nk: int, dk: int, nv: int, dv: int) -> np.ndarray:
    """Rows of llama.cpp's [q | k | v | z] (each all heads) in mlx_lm's per-key-head [q k v z] order."""
    per = nv // nk * dv
    z0 = 2 * nk * dk + nv * dv
    order = []
    for h in range(nk):
        order += [
            np.arange(h * dk, (h + 1) * dk),
            nk * dk + np.arange(h * dk, (h + 1) * dk),
            2 * nk * dk + np.arange(h * per, (h + 1) * per),
            z0 + np.arange(h * per, (h + 1) * per),
        ]
    return np.concatenate(order)


def _linear_attn_layer(family: Family, config: dict, parts: dict[str, Value]) -> dict[str, Value]:
    """GGUF linear-attention tensors of one layer -> mlx_lm's (values keyed by mlx_lm suffix)."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    out = {}
    a = parts.pop("ssm_a.weight", None)
    if a is not None:
        out["linear_attn.A_log"] = np.log(-np.asarray(a, np.float32))
    dt = parts.pop("ssm_dt.bias", None)
    if dt is not None:
        out["linear_attn.dt_bias"] = np.asarray(dt, np.float32)
    conv = parts.pop("ssm_conv1d.weight", None)
    if conv is not None:
        out["linear_attn.conv1d.weight"] = np.asarray(conv, np.float32)[..., None]
    if "attn_qkv.weight" not in parts:
        return out  # a full-attention layer
    if family.model_type == "qwen3_next":
        joined = cat_rows([parts.pop("attn_qkv.weight"), parts.pop("attn_gate.weight")])
        out["linear_attn.in_proj_qkvz.weight"] = take_rows(joined, _qkvz_order(nk, dk, nv, dv))
    elif nv != nk:
        # Qwen3.5 with more value than key heads: value heads back to grouped order
        # everywhere they appear (rows of qkv, z, b, a; A_log, dt_bias; conv channels; out_proj columns).
        per, qk = nv // nk, 2 * nk * dk
        v_rows = np.concatenate([np.arange(qk), qk + _untile(nv * dv, nk, per, dv)])
        heads = _untile(nv, nk, per, 1)
        parts["attn_qkv.weight"] = take_rows(parts["attn_qkv.weight"], v_rows)
        for name, order in (("attn_gate.weight", v_rows[qk:] - qk), ("ssm_beta.weight", heads), ("ssm_alpha.weight", heads)):
            if name in parts:
                parts[name] = take_rows(parts[name], order)
        for name in ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d.weight"):
            if name in out:
                out[name] = out[name][v_rows if "conv1d" in name else heads]
        if "ssm_out.weight" in parts:
            parts["ssm_out.weight"] = permute_cols(parts["ssm_out.weight"], heads, dv)
    return out


def _split_gate_up(parts: dict[str, Value]) -> None:
    """llama.cpp's optional fused experts (``ffn_gate_up_exps``: gate rows, then up rows) -> the two."""
    for kind in ("weight", "bias"):
        fused = parts.pop(f"ffn_gate_up_exps.{kind}", None)
        if fused is None:
            continue
        half = fused.shape[-2 if kind == "weight" else -1] // 2
        if kind == "weight":
            parts["ffn_gate_exps.weight"] = take_rows(fused, np.arange(half))
            parts["ffn_up_exps.weight"] = take_rows(fused, half + np.arange(half))
        else:
            parts["ffn_gate_exps.bias"], parts["ffn_up_exps.bias"] = fused[..., :half], fused[..., half:]


def _shift(family: Family, value: Value) -> Value:
    if not family.norm_shift:
        return value
    return np.asarray(value, np.float32) - np.float32(family.norm_shift)


def mlx_weights(family: Family, config: dict, tensors: dict[str, Value]) -> dict[str, Value]:
    """GGUF tensors (name -> value) -> mlx_lm parameter name -> value, every layout change undone."""
    out: dict[str, Value] = {}
    layers: dict[int, dict[str, Value]] = {}
    for name, value in tensors.items():
        if m := _LAYER_RE.match(name):
            layers.setdefault(int(m.group(1)), {})[f"{m.group(2)}.{m.group(3) or 'weight'}"] = value
        elif name == "token_embd.weight":
            out[f"{family.prefix}.embed_tokens.weight"] = value
        elif name == "output_norm.weight":
            out[f"{family.prefix}.norm.weight"] = _shift(family, value)
        elif name == "output.weight":
            out[f"{family.head}.weight"] = value
        elif name.removesuffix(".weight") in family.globals:
            out[f"{family.prefix}.{family.globals[name.removesuffix('.weight')]}.weight"] = value
    for i, parts in sorted(layers.items()):
        if i >= config["num_hidden_layers"]:
            continue  # multi-token-prediction blocks
        base = f"{family.prefix}.layers.{i}"
        _split_gate_up(parts)
        if "linear_num_key_heads" in config:
            for suffix, v in _linear_attn_layer(family, config, parts).items():
                out[f"{base}.{suffix}"] = v
        for key, value in parts.items():
            part, kind = key.rsplit(".", 1)
            if kind == "scale":
                if part in family.scales:
                    out[f"{base}.{family.scales[part]}"] = value
                continue
            if part not in family.layers:
                continue  # tensors mlx_lm has no place for (e.g. MTP heads)
            target = family.layers[part]
            if family.permute_qk and part in ("attn_q", "attn_k") and kind == "weight":
                heads = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
                value = _unpermute_qk(value, heads)
            if part.endswith("norm") and kind == "weight":
                value = _shift(family, value)
            # attention sinks and Gemma 4's layer scalar are bare parameters in mlx_lm, not a module's weight
            out[f"{base}.{target}" if target.endswith(_BARE) else f"{base}.{target}.{kind}"] = value
    return out
