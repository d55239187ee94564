"""llama-family GGUF files as mlx_lm models.

``mx.load`` reads GGUF directly: F32/F16 tensors come back as float arrays,
Q4_0/Q4_1/Q8_0 already in MLX's affine quantized layout (``weight`` packed in
uint32, ``scales`` and ``biases`` per group of 32). What is left is naming,
configuration and one layout difference: llama.cpp's converter permutes the
rows of the Q and K projections of llama-architecture models so that its RoPE
can rotate adjacent pairs; mlx_lm's llama rotates the two halves of each head
like Hugging Face does, so the permutation is undone here.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes

from shared.errors import ModelLoadError

from .gguf_tokenizer import build_tokenizer_dir, meta_list, meta_value

# GGUF architecture -> mlx_lm model module.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose Q/K rows llama.cpp's converter permutes.
_PERMUTED = {"llama", "mistral"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)$")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias|scales|biases)$")


@dataclass
class GGUFModel:
    model: nn.Module
    config: dict
    tokenizer_dir: Path
    eos_token_ids: list[int]
    bos_token_id: int | None


def mlx_name(gguf_name: str) -> str | None:
    """The mlx_lm parameter name of a GGUF tensor, or None for tensors mlx_lm has no place for."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        return None
    if (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row order: per head, rows (pair, half) -> (half, pair).

    Works on any tensor whose first axis is the output rows, so a quantized
    weight, its scales and its biases are permuted alike without dequantizing
    (quantization groups run along the input axis).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_metadata(meta: dict, weights: dict, path: str) -> dict:
    """An HF-style config.json dict for mlx_lm's ModelArgs, read from GGUF metadata."""
    arch = meta_value(meta, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )

    def get(key, default=None):
        return meta_value(meta, f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if hasattr(kv_heads, "__len__"):
        raise ModelLoadError(f"{path}: per-layer KV head counts are not supported")
    head_dim = int(get("attention.key_length", hidden // heads))
    vocab = get("vocab_size") or len(meta_list(meta, "tokenizer.ggml.tokens")) or weights["token_embd.weight"].shape[0]
    config = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_up.bias" in weights,
    }
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not supported for GGUF files")
    if "rope_freqs.weight" in weights:
        # Llama 3.x stores its RoPE frequency factors as a tensor; the
        # llama3 rope class is built neutral here and its frequencies are
        # replaced by the file's in _apply_rope_freqs.
        config["rope_scaling"] = {"type": "llama3", "factor": 1.0}
    return config


def _apply_rope_freqs(model: nn.Module, factors: mx.array, config: dict) -> None:
    dims = config["head_dim"]
    base = config["rope_theta"]
    freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)
    for layer in model.model.layers:
        layer.self_attn.rope._freqs = freqs


def _quant_params(weights: dict) -> dict[str, dict]:
    """Per module: group size and bits of each quantized tensor (they differ, e.g. 8-bit embeddings)."""
    params = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        prefix = name[: -len(".scales")]
        in_dims = scales.shape[-1] * 32  # GGUF's Q4_0/Q4_1/Q8_0 blocks are 32 wide
        bits = weights[f"{prefix}.weight"].shape[-1] * 32 // in_dims
        params[prefix] = {"group_size": 32, "bits": bits}
    return params


# GGUF value types -> byte size of fixed-size scalars (8 = string, 9 = array).
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# ggml tensor types -> (block width, bytes per block), for the types checked here.
_BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 30: (1, 2)}


def check_gguf_structure(path: str) -> None:
    """Walk the GGUF header, metadata and tensor table; raise ModelLoadError if anything is out of bounds.

    MLX's GGUF reader trusts the counts and offsets in the file, so a
    truncated or corrupt file crashes the process instead of raising; this
    walk reads only the header and table, not the tensor data.
    """

    def bad(why: str):
        return ModelLoadError(f"{path}: cannot read GGUF file ({why})")

    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise bad("empty file") from None
    with buf:
        size, pos = len(buf), 0

        def take(n: int) -> bytes:
            nonlocal pos
            if n < 0 or pos + n > size:
                raise bad("truncated or corrupt header")
            pos += n
            return buf[pos - n : pos]

        def u32() -> int:
            return struct.unpack("<I", take(4))[0]

        def u64() -> int:
            return struct.unpack("<Q", take(8))[0]

        def string() -> bytes:
            return take(u64())

        def skip_value(kind: int) -> None:
            if kind in _SCALAR_SIZE:
                take(_SCALAR_SIZE[kind])
            elif kind == 8:
                string()
            elif kind == 9:
                inner, count = u32(), u64()
                if inner in _SCALAR_SIZE:
                    take(_SCALAR_SIZE[inner] * count)
                elif inner == 8:
                    for _ in range(count):
                        string()
                else:
                    raise bad(f"unsupported array element type {inner}")
            else:
                raise bad(f"unknown metadata value type {kind}")

        if take(4) != b"GGUF":
            raise bad("not a GGUF file")
        if (version := u32()) not in (2, 3):
            raise bad(f"unsupported GGUF version {version}")
        n_tensors, n_kv = u64(), u64()
        if n_tensors > size or n_kv > size:
            raise bad("corrupt header counts")
        alignment = 32
        for _ in range(n_kv):
            key, kind = string(), u32()
            if key == b"general.alignment" and kind == 4:
                alignment = struct.unpack("<I", buf[pos : pos + 4])[0] if pos + 4 <= size else 0
                if alignment == 0 or alignment & (alignment - 1):
                    raise bad("bad alignment")
            skip_value(kind)
        tensors = []
        for _ in range(n_tensors):
            name = string()
            n_dims = u32()
            if n_dims > 4:
                raise bad(f"tensor {name!r} has {n_dims} dimensions")
            dims = [u64() for _ in range(n_dims)]
            tensors.append((name, dims, u32(), u64()))
        data_start = -(-pos // alignment) * alignment
        for name, dims, kind, offset in tensors:
            count = 1
            for d in dims:
                count *= d
            width, nbytes = _BLOCK.get(kind, (1, 0))
            if count % width or data_start + offset + count // width * nbytes > size:
                raise bad(f"tensor {name.decode(errors='replace')!r} lies outside the file")


def load_gguf(path: str | Path) -> GGUFModel:
    """Build the mlx_lm model of a GGUF file, with its checkpoint's (quantized) weights, evaluated."""
    path = str(path)
    check_gguf_structure(path)
    try:
        raw, meta = mx.load(path, return_metadata=True)
    except Exception as e:  # mx.load raises plain RuntimeError/ValueError for unreadable or unsupported files
        raise ModelLoadError(f"{path}: cannot read GGUF file ({e})") from e

    config = config_from_metadata(meta, raw, path)
    permute = meta_value(meta, "general.architecture") in _PERMUTED
    weights = {}
    for name, w in raw.items():
        new = mlx_name(name)
        if new is None:
            continue
        if permute and (".q_proj." in new or ".k_proj." in new) and not new.endswith(".bias"):
            heads = config["num_attention_heads"] if ".q_proj." in new else config["num_key_value_heads"]
            w = unpermute_rows(w, heads)
        weights[new] = w

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    quant = _quant_params(weights)
    if quant:
        nn.quantize(model, class_predicate=lambda p, m: quant.get(p, False) if hasattr(m, "to_quantized") else False)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensors do not match the {config['model_type']} architecture ({e})") from e
    if "rope_freqs.weight" in raw:
        _apply_rope_freqs(model, raw["rope_freqs.weight"], config)
    mx.eval(model.parameters())

    tokens = meta_list(meta, "tokenizer.ggml.tokens")
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        idx = meta_value(meta, key)
        if idx is not None and int(idx) not in eos:
            eos.append(int(idx))
    # Chat models converted without an eot id still end turns with their
    # template's end marker; stopping on it is what every chat client expects.
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        if marker in tokens and tokens.index(marker) not in eos:
            eos.append(tokens.index(marker))
    bos = meta_value(meta, "tokenizer.ggml.bos_token_id")
    return GGUFModel(
        model=model,
        config=config,
        tokenizer_dir=build_tokenizer_dir(meta, path),
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
    )
