"""Tiny mlx_lm models written as GGUF files the way llama.cpp's converter writes each family.

Independent of mlxd's loader: tensor names come from the `gguf` package's own
``TensorNameMap`` (llama.cpp's table), and the layout changes are those
convert_hf_to_gguf.py makes (norms stored as 1 + w for Gemma 3, ``A_log`` as
``-exp(A_log)``, the Qwen3-Next qkvz split, Qwen3.5's tiled value heads,
squeezed conv kernels). Every change is a permutation/reshape of elements
after an elementwise map, so the weights that a file holds, seen back in
mlx_lm's layout (``roundtrip``), are found by converting an index array the
same way and scattering the file's dequantized values back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.gguf_kquants import ENCODERS
from tests.tiny_models import CHAT_TEMPLATE, load_tiny_weights, make_tiny_model, tiny_vocab

QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's choice when a row is not a whole number of 256-wide K-quant blocks.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# mlx_lm model_type -> (GGUF architecture, gguf MODEL_ARCH name)
ARCH = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "qwen3_next": "qwen3next",
    "qwen3_5": "qwen35",
    "qwen3_5_moe": "qwen35moe",
    "gemma3_text": "gemma3",
    "gpt_oss": "gpt-oss",
    "gemma4_text": "gemma4",
}
FAMILIES = tuple(ARCH)

# Every weight row a whole number of K-quant blocks (256) where the family allows it.
_WIDE = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
_HYBRID = {"num_hidden_layers": 2, "linear_key_head_dim": 64, "linear_value_head_dim": 64}
OVERRIDES = {
    "qwen3": {},
    # llama.cpp's qwen3moe has no dense-FFN layers
    "qwen3_moe": {"moe_intermediate_size": 256, "mlp_only_layers": []},
    "qwen3_next": {**_HYBRID, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256},
    "qwen3_5": _HYBRID,
    "qwen3_5_moe": {**_HYBRID, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256},
    # llama.cpp's gemma3: every 6th layer global, queries scaled by head_dim ** -0.5.
    "gemma3_text": {"num_hidden_layers": 6, "sliding_window_pattern": 6, "query_pre_attn_scalar": 64},
    "gpt_oss": {},
}
# Gemma 4 (E-series layout): sliding and global layers with their own head sizes and RoPE,
# the last two layers sharing earlier layers' K/V with double-wide MLPs, per-layer inputs.
# tests/tiny_models.py has no Gemma 4, so its config is written here.
GEMMA4 = {
    "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 4,
    "global_head_dim": 128, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 64, "vocab_size_per_layer_input": 272, "sliding_window": 12,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
}


# Gemma 4's MoE layout (26B-A4B): experts beside the dense MLP, K = V on the global layers.
GEMMA4_MOE = {
    **GEMMA4, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
    "num_kv_shared_layers": 0, "use_double_wide_mlp": False, "hidden_size_per_layer_input": 0,
    "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 256,
    "attention_k_eq_v": True, "num_global_key_value_heads": 1,
}


def make_family_model(directory, family: str, seed: int) -> Path:
    """``family``: an mlx_lm model_type of FAMILIES, or "gemma4_moe"."""
    if family in ("gemma4_text", "gemma4_moe"):
        return _make_gemma4(Path(directory), seed, GEMMA4 if family == "gemma4_text" else GEMMA4_MOE)
    return make_tiny_model(directory, family, seed=seed, **_WIDE, **OVERRIDES[family])


def _make_gemma4(out: Path, seed: int, layout: dict) -> Path:
    import mlx.core as mx

    from tests import tiny_models

    config = {**tiny_models._BASE, **_WIDE, **layout}
    out.mkdir(parents=True, exist_ok=True)
    weights = tiny_models._random_weights(config, seed)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    tiny_models._write_tokenizer(out, config)
    return out


def _text(config: dict) -> dict:
    return {**config, **config.get("text_config", {})}


def _elementwise(family: str, name: str):
    """(forward, inverse) of the converter's value change for this tensor, or None."""
    if name.endswith(".A_log"):
        return (lambda x: -np.exp(x)), (lambda y: np.log(-y))
    if family == "gemma3_text" and name.endswith("norm.weight"):
        return (lambda x: x + np.float32(1)), (lambda y: y - np.float32(1))
    return None


def _tile_v(a: np.ndarray, axis: int, nk: int, per: int, width: int) -> np.ndarray:
    """HF's value heads grouped by key head -> llama.cpp's tiled order, along ``axis``."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(nk, per, width, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(a, 0, axis)


def _structure(family: str, c: dict, name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """mlx_lm tensor -> [(HF-style name, array)] as llama.cpp lays it out (permutations and reshapes only)."""
    name = name.removeprefix("language_model.")
    name = name.replace(".mlp.switch_mlp.", ".mlp.experts.")
    if name.endswith("linear_attn.dt_bias"):
        name = name.replace("linear_attn.dt_bias", "linear_attn.dt_proj.bias")
    if name.endswith("conv1d.weight"):
        w = w[..., 0]
    if family in ("qwen3_5", "qwen3_5_moe") and "linear_attn." in name and c["linear_num_value_heads"] != c["linear_num_key_heads"]:
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv, per = c["linear_key_head_dim"], c["linear_value_head_dim"], nv // nk
        qk = 2 * nk * dk
        if "in_proj_qkv" in name or "conv1d" in name:
            w = np.concatenate([w[:qk], _tile_v(w[qk:], 0, nk, per, dv)])
        elif "in_proj_z" in name:
            w = _tile_v(w, 0, nk, per, dv)
        elif any(k in name for k in ("in_proj_a", "in_proj_b", "A_log", "dt_proj")):
            w = _tile_v(w, 0, nk, per, 1)
        elif "out_proj" in name:
            w = _tile_v(w, 1, nk, per, dv)
    if family == "qwen3_next" and name.endswith("in_proj_qkvz.weight"):
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        g = w.reshape(nk, -1, w.shape[-1])
        q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + nv // nk * dv], axis=1)
        flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
        base = name.replace("in_proj_qkvz.weight", "")
        return [(f"{base}in_proj_qkv.weight", np.concatenate(flat[:3])), (f"{base}in_proj_z.weight", flat[3])]
    return [(name, w)]


def _gguf_names(family: str, layers: int):
    import gguf

    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[ARCH[family]]
    names = gguf.get_tensor_name_map(arch, layers)
    qwen3_next_parts = {"in_proj_qkv": "attn_qkv", "in_proj_z": "attn_gate"}

    def name_of(hf: str) -> str:
        if hf.endswith(("sinks", "layer_scalar", "A_log")):
            # bare parameters: the converter adds ".weight" to gpt-oss's sinks and Gemma 4's
            # layer scalar; ssm_a keeps no suffix at all (as Mamba's does)
            return names.get_name(hf) + ("" if hf.endswith("A_log") else ".weight")
        if family == "gemma4_text" and (gemma := _gemma4_moe_name(hf)):
            return gemma
        base, suffix = hf.rsplit(".", 1)
        if family == "qwen3_next" and base.rsplit(".", 1)[-1] in qwen3_next_parts:
            # the converter names these two itself (ATTN_QKV, ATTN_GATE)
            layer = base.split(".")[2]
            return f"blk.{layer}.{qwen3_next_parts[base.rsplit('.', 1)[-1]]}.{suffix}"
        mapped = names.get_name(base)
        if mapped is None:
            raise KeyError(f"gguf's tensor map has no name for {hf}")
        return f"{mapped}.{suffix}"

    return name_of


def _gemma4_moe_name(hf: str) -> str | None:
    """Gemma 4's expert tensors as the converter names them (gate and up are fused afterwards)."""
    layer = hf.split(".")[2] if hf.startswith("model.layers.") else None
    names = {
        "experts.switch_glu.gate_proj.weight": "ffn_gate_exps.weight",
        "experts.switch_glu.up_proj.weight": "ffn_up_exps.weight",
        "experts.switch_glu.down_proj.weight": "ffn_down_exps.weight",
        "router.scale": "ffn_gate_inp.scale",
        "router.per_expert_scale": "ffn_down_exps.scale",
    }
    for suffix, name in names.items():
        if layer is not None and hf.endswith(suffix):
            return f"blk.{layer}.{name}"
    return None


def _qtype_for(name: str, shape: tuple, qtype: str | dict) -> str:
    """The ggml type of one tensor; ``qtype`` a type, or {substring of the HF name: type, "": default}."""
    # llama-quantize quantizes only weight matrices; biases (gpt-oss's are 2-D) stay float32
    if len(shape) == 1 or shape[-1] % 32 or name.endswith(".bias"):
        return "F32"
    if isinstance(qtype, dict):
        qtype = next((t for key, t in qtype.items() if key and key in name), qtype[""])
    if qtype in _FALLBACK and shape[-1] % 256:
        return _FALLBACK[qtype]
    return qtype


def _encode(w: np.ndarray, qtype: str):
    from gguf import GGMLQuantizationType, quants

    if qtype in ENCODERS:
        return ENCODERS[qtype](w)
    return quants.quantize(w, GGMLQuantizationType[qtype])


def converted_tensors(model_dir, qtype: str | dict) -> tuple[dict, dict, list[tuple[str, np.ndarray, str]]]:
    """(config, weights, [(GGUF name, converted float32 array, its ggml type)])."""
    config, weights = load_tiny_weights(model_dir)
    family, c = config["model_type"], _text(config)
    name_of = _gguf_names(family, c["num_hidden_layers"])
    out = []
    for name, w in weights.items():
        ew = _elementwise(family, name)
        for hf, part in _structure(family, c, name, ew[0](w) if ew else w):
            out.append((name_of(hf), np.ascontiguousarray(part, np.float32), _qtype_for(hf, part.shape, qtype)))
    return config, weights, out


def roundtrip(model_dir, gguf_path) -> dict[str, np.ndarray]:
    """The weights the GGUF file holds, read and dequantized by the gguf package, in mlx_lm's names and layout."""
    from gguf import GGUFReader, quants

    config, weights = load_tiny_weights(model_dir)
    family, c = config["model_type"], _text(config)
    name_of = _gguf_names(family, c["num_hidden_layers"])
    held = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}

    def values(name: str) -> np.ndarray:
        if name in held:
            t = held[name]
            return np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        # one half of a fused ffn_gate_up_exps (gate rows first)
        fused = values(name.replace("ffn_gate_exps", "ffn_gate_up_exps").replace("ffn_up_exps", "ffn_gate_up_exps"))
        half = fused.shape[-2] // 2
        return fused[..., :half, :] if "ffn_gate_exps" in name else fused[..., half:, :]

    out = {}
    for name, w in weights.items():
        ew = _elementwise(family, name)
        back = np.empty(w.size, np.float32)
        for hf, idx in _structure(family, c, name, np.arange(w.size).reshape(w.shape)):
            back[idx.reshape(-1)] = values(name_of(hf)).reshape(-1)
        back = back.reshape(w.shape)
        out[name] = ew[1](back) if ew else back
    return out


def _fuse_gate_up(tensors: list) -> list:
    """The converter's --fuse-gate-up-exps: ffn_gate_exps and ffn_up_exps as one tensor, gate rows first."""
    by_name = {n: (a, t) for n, a, t in tensors}
    out = []
    for name, array, t in tensors:
        if ".ffn_up_exps." in name:
            continue
        if ".ffn_gate_exps." in name:
            up, _ = by_name[name.replace("ffn_gate_exps", "ffn_up_exps")]
            axis = -2 if name.endswith(".weight") else -1
            out.append((name.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate([array, up], axis=axis), t))
        else:
            out.append((name, array, t))
    return out


def _mtp_block(tensors: list, layers: int) -> list:
    """A stand-in multi-token-prediction block after the decoder layers (what Qwen3.5 files carry)."""
    return [(n.replace("blk.1.", f"blk.{layers}.", 1), a, t) for n, a, t in tensors if n.startswith("blk.1.")]


def _gemma4_metadata(w, c: dict) -> None:
    """What llama.cpp's Gemma4Model.set_gguf_parameters writes on top of the common keys."""
    n, shared = c["num_hidden_layers"], c["num_kv_shared_layers"]
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c["hidden_size_per_layer_input"])
    swa = [t == "sliding_attention" for t in c["layer_types"]]
    w.add_sliding_window_pattern(swa)
    kv, global_kv = c["num_key_value_heads"], c.get("num_global_key_value_heads")
    w.add_head_count_kv([kv if s else global_kv for s in swa] if global_kv else kv)
    w.add_key_length(c["global_head_dim"])
    w.add_value_length(c["global_head_dim"])
    w.add_key_length_swa(c["head_dim"])
    w.add_value_length_swa(c["head_dim"])
    ff = c["intermediate_size"]
    w.add_feed_forward_length([ff if i < n - shared else 2 * ff for i in range(n)] if c["use_double_wide_mlp"] else ff)
    w.add_rope_dimension_count(c["global_head_dim"])
    w.add_rope_dimension_count_swa(c["head_dim"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])


def _gemma4_rope_freqs(c: dict) -> np.ndarray:
    # the global layers' proportional RoPE: rotated pairs factor 1, the rest 1e30 (never turn)
    rotated = int(c["global_head_dim"] * 0.25 / 2)
    return np.array([1.0] * rotated + [1e30] * (c["global_head_dim"] // 2 - rotated), np.float32)


def write_family_gguf(model_dir, path, qtype: str | dict, fuse_gate_up: bool = False, mtp: bool = False) -> Path:
    """Write the tiny model in ``model_dir`` as llama.cpp's converter would.

    ``qtype``: the ggml type of every weight matrix, or a dict {substring of
    the HF tensor name: type, "": default} for mixed files like real ones.
    Rows that are not whole K-quant blocks fall back as llama.cpp does.
    ``fuse_gate_up``: experts' gate and up in one tensor (the converter's
    option); ``mtp``: one multi-token-prediction block counted in block_count.
    """
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType

    config, _, tensors = converted_tensors(model_dir, qtype)
    family, c = config["model_type"], _text(config)
    if fuse_gate_up or family == "gemma4_text":  # Gemma 4's checkpoints hold them fused already
        tensors = _fuse_gate_up(tensors)
    if mtp:
        tensors += _mtp_block(tensors, c["num_hidden_layers"])
    path = Path(path)
    w = GGUFWriter(str(path), ARCH[family])
    w.add_name(f"tiny-{family}")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"] + int(mtp))
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_head_count(c["num_attention_heads"])
    if family != "gemma4_text":  # Gemma 4 writes these per layer kind (_gemma4_metadata)
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    if family == "gemma4_text":  # the global layers' base, mlx_lm's default when config.json has none
        w.add_rope_freq_base(float(rope.get("full_attention", {}).get("rope_theta", 1000000.0)))
    else:
        w.add_rope_freq_base(float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))
    experts = c.get("num_experts") or c.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.get("num_experts_per_tok") or c["top_k_experts"])
        w.add_expert_feed_forward_length(c.get("moe_intermediate_size") or c["intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if "linear_num_key_heads" in c:
        w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        w.add_ssm_state_size(c["linear_key_head_dim"])
        w.add_ssm_group_count(c["linear_num_key_heads"])
        w.add_ssm_time_step_rank(c["linear_num_value_heads"])
        w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
        w.add_full_attention_interval(c["full_attention_interval"])
        factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
        w.add_rope_dimension_count(int(c["head_dim"] * factor))
    if "sliding_window" in c:
        w.add_sliding_window(c["sliding_window"])
    if family == "gemma4_text":
        _gemma4_metadata(w, c)


    tokens, merges, special = tiny_vocab(c["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_token_types([TokenType.CONTROL if s else TokenType.NORMAL for s in special])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    if family == "gemma4_text":
        w.add_tensor("rope_freqs.weight", _gemma4_rope_freqs(c))
    for name, array, t in tensors:
        if t in ("F32", "F16"):
            data = array.astype(np.float32 if t == "F32" else np.float16)
        else:
            data = _encode(array, t)
        raw = None if t in ("F32", "F16") else GGMLQuantizationType[t]
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
