"""Whisper checkpoints -> ``whisper.Whisper``: CTranslate2, Hugging Face and mlx-community folders.

- CTranslate2 (faster-whisper's format): ``model.bin`` read here (its layout: a version, the spec's
  name and revision, then named tensors with rank, shape, dtype and bytes, then aliases) and
  converted at load; int8 weights come with a per-row ``weight_scale`` and are dequantized.
- Hugging Face ``openai/whisper-*``: ``config.json`` (``model_type`` whisper) + safetensors.
- mlx-community Whisper: ``config.json`` with ``n_audio_state`` + ``weights.safetensors`` or
  ``weights.npz`` already in this module's names (less the encoder's sinusoidal positions).

Every format needs a ``tokenizer.json`` beside the weights (CTranslate2 and Hugging Face folders
carry one); the weights load as float32 on the CPU and float16 on a GPU.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxd.engined.speech.whisper import Whisper, WhisperArgs
from mlxd.shared.errors import ModelLoadError

_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def checkpoint_format(path: Path) -> str | None:
    """"ct2", "hf" or "mlx" for a Whisper folder, else None."""
    if not (path / "config.json").is_file():
        return None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if (path / "model.bin").is_file() and _ct2_spec(path / "model.bin") == "WhisperSpec":
        return "ct2"
    if "n_audio_state" in config and "n_text_state" in config:  # mlx-community's may say model_type whisper too
        return "mlx"
    if config.get("model_type") == "whisper":
        return "hf"
    return None


def load_whisper(path: Path, dtype) -> Whisper:
    fmt = checkpoint_format(path)
    if fmt is None:
        raise ModelLoadError(f"{path} is not a Whisper folder (CTranslate2, Hugging Face or mlx-community)")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json (copy the one of openai/whisper-* beside the weights)")
    try:
        args, weights = {"ct2": _from_ct2, "hf": _from_hf, "mlx": _from_mlx}[fmt](path)
    except (OSError, KeyError, ValueError, struct.error) as e:
        raise ModelLoadError(f"{path}: cannot read the Whisper weights ({type(e).__name__}: {e})") from e
    model = Whisper(args)
    model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    return model


def sinusoids(length: int, channels: int) -> np.ndarray:
    """The encoder's fixed positions (Whisper's sinusoids: sines then cosines, log-spaced periods)."""
    step = math.log(10000) / (channels // 2 - 1)
    inv = np.exp(-step * np.arange(channels // 2))
    t = np.arange(length)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


# -- CTranslate2 ------------------------------------------------------------------------------


def _ct2_spec(path: Path) -> str | None:
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 6:
        return None
    n = struct.unpack_from("<H", head, 4)[0]
    return head[6:6 + n].rstrip(b"\0").decode("utf-8", "replace")


def read_ct2(path: Path) -> dict[str, np.ndarray]:
    """The named tensors of a CTranslate2 ``model.bin`` (aliases resolved), as numpy arrays."""
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def text() -> str:
        nonlocal pos
        n = take("H")
        s = data[pos:pos + n].rstrip(b"\0").decode()
        pos += n
        return s

    version = take("I")
    if version < 5:
        raise ValueError(f"model.bin version {version} is older than this reader knows (5)")
    text()  # the spec's name, checked by checkpoint_format
    take("I")  # its revision
    tensors: dict[str, np.ndarray] = {}
    for _ in range(take("I")):
        name = text()
        rank = take("B")
        shape = [take("I") for _ in range(rank)]
        dtype = _CT2_DTYPES.get(take("B"))
        nbytes = take("I")
        if dtype is None:
            raise ValueError(f"{name}: a dtype this reader does not know")
        tensors[name] = np.frombuffer(data, dtype, nbytes // np.dtype(dtype).itemsize, pos).reshape(shape)
        pos += nbytes
    for _ in range(take("I")):
        alias, target = text(), text()
        tensors[alias] = tensors[target]
    return tensors


def _ct2_weight(t: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    w = t[f"{prefix}/weight"]
    scale = t.get(f"{prefix}/weight_scale")
    if scale is not None:  # int8 rows: w_float = w_int8 / scale (one scale per output row)
        return w.astype(np.float32) / scale.astype(np.float32).reshape(-1, 1)
    return w.astype(np.float32)


def _from_ct2(path: Path):
    t = read_ct2(path / "model.bin")
    emb = t["decoder/embeddings/weight"]
    enc_pos, dec_pos = t["encoder/position_encodings/encodings"], t["decoder/position_encodings/encodings"]
    n_enc = len({k.split("/")[1] for k in t if re.match(r"encoder/layer_\d+/", k)})
    n_dec = len({k.split("/")[1] for k in t if re.match(r"decoder/layer_\d+/", k)})
    args = WhisperArgs(
        n_mels=t["encoder/conv1/weight"].shape[1], n_audio_ctx=enc_pos.shape[0], n_audio_state=enc_pos.shape[1],
        n_audio_head=int(t["encoder/num_heads"]), n_audio_layer=n_enc, n_vocab=emb.shape[0],
        n_text_ctx=dec_pos.shape[0], n_text_state=emb.shape[1], n_text_head=int(t["decoder/num_heads"]),
        n_text_layer=n_dec)
    w: dict[str, np.ndarray] = {}

    def linear(dst: str, src: str, rows: slice | None = None, bias: bool = True):
        weight = _ct2_weight(t, src)
        b = t.get(f"{src}/bias")
        if rows is not None:
            weight, b = weight[rows], (b[rows] if b is not None else None)
        w[f"{dst}.weight"] = weight
        if bias:
            w[f"{dst}.bias"] = b.astype(np.float32)

    def norm(dst: str, src: str):
        w[f"{dst}.weight"], w[f"{dst}.bias"] = t[f"{src}/gamma"], t[f"{src}/beta"]

    def fused_qkv(dst: str, src: str, d: int):  # [q; k; v] rows in one linear (k's bias is zero)
        for i, name in enumerate(("query", "key", "value")):
            linear(f"{dst}.{name}", src, slice(i * d, (i + 1) * d), bias=name != "key")

    def self_attention_and_mlp(dst: str, src: str, d: int):  # what encoder and decoder blocks share
        fused_qkv(f"{dst}.attn", f"{src}/self_attention/linear_0", d)
        linear(f"{dst}.attn.out", f"{src}/self_attention/linear_1")
        norm(f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
        linear(f"{dst}.mlp1", f"{src}/ffn/linear_0")
        linear(f"{dst}.mlp2", f"{src}/ffn/linear_1")
        norm(f"{dst}.mlp_ln", f"{src}/ffn/layer_norm")

    for i in range(2):
        conv = f"encoder/conv{i + 1}"
        w[f"encoder.conv{i + 1}.weight"] = _ct2_weight(t, conv).transpose(0, 2, 1)
        w[f"encoder.conv{i + 1}.bias"] = t[f"{conv}/bias"]
    w["encoder.positional_embedding"] = enc_pos
    for n in range(n_enc):
        self_attention_and_mlp(f"encoder.blocks.{n}", f"encoder/layer_{n}", args.n_audio_state)
    norm("encoder.ln_post", "encoder/layer_norm")
    d = args.n_text_state
    w["decoder.token_embedding.weight"] = emb
    w["decoder.positional_embedding"] = dec_pos
    for n in range(n_dec):
        src, dst = f"decoder/layer_{n}", f"decoder.blocks.{n}"
        self_attention_and_mlp(dst, src, d)
        linear(f"{dst}.cross_attn.query", f"{src}/attention/linear_0")
        linear(f"{dst}.cross_attn.key", f"{src}/attention/linear_1", slice(0, d), bias=False)
        linear(f"{dst}.cross_attn.value", f"{src}/attention/linear_1", slice(d, 2 * d))
        linear(f"{dst}.cross_attn.out", f"{src}/attention/linear_2")
        norm(f"{dst}.cross_attn_ln", f"{src}/attention/layer_norm")
    norm("decoder.ln", "decoder/layer_norm")
    return args, {k: mx.array(np.ascontiguousarray(v, dtype=np.float32)) for k, v in w.items()}


# -- Hugging Face -----------------------------------------------------------------------------

_HF_NAMES = (
    ("model.encoder.embed_positions.weight", "encoder.positional_embedding"),
    ("model.decoder.embed_positions.weight", "decoder.positional_embedding"),
    ("model.decoder.embed_tokens", "decoder.token_embedding"),
    ("model.encoder.layer_norm", "encoder.ln_post"),
    ("model.decoder.layer_norm", "decoder.ln"),
    ("model.", ""),
    (".layers.", ".blocks."),
    (".self_attn_layer_norm", ".attn_ln"),
    (".encoder_attn_layer_norm", ".cross_attn_ln"),
    (".final_layer_norm", ".mlp_ln"),
    (".self_attn.", ".attn."),
    (".encoder_attn.", ".cross_attn."),
    ("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("out_proj", "out"),
    (".fc1", ".mlp1"), (".fc2", ".mlp2"),
)


def _hf_name(name: str) -> str:
    for old, new in _HF_NAMES:
        name = name.replace(old, new)
    return name


def _safetensors(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError("no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def _from_hf(path: Path):
    c = json.loads((path / "config.json").read_text())
    args = WhisperArgs(
        n_mels=c["num_mel_bins"], n_audio_ctx=c["max_source_positions"], n_audio_state=c["d_model"],
        n_audio_head=c["encoder_attention_heads"], n_audio_layer=c["encoder_layers"], n_vocab=c["vocab_size"],
        n_text_ctx=c["max_target_positions"], n_text_state=c["d_model"], n_text_head=c["decoder_attention_heads"],
        n_text_layer=c["decoder_layers"])
    weights = {}
    for name, value in _safetensors(path).items():
        if name == "proj_out.weight":  # tied to the token embedding
            continue
        if ".conv" in name and name.endswith(".weight"):
            value = value.transpose(0, 2, 1)  # torch's [out, in, k] -> MLX's [out, k, in]
        weights[_hf_name(name)] = value
    return args, weights


# -- mlx-community ----------------------------------------------------------------------------


def _from_mlx(path: Path):
    c = json.loads((path / "config.json").read_text())
    args = WhisperArgs(**{f: c[f] for f in WhisperArgs.__dataclass_fields__})
    if (path / "weights.npz").is_file():
        weights = dict(mx.load(str(path / "weights.npz")))
    else:
        weights = _safetensors(path)
    if "quantization" in c:
        raise ValueError("quantized mlx-community Whisper weights are not supported; use a float checkpoint")
    weights = {k: v for k, v in weights.items() if k != "alignment_heads"}
    weights.setdefault("encoder.positional_embedding", mx.array(sinusoids(args.n_audio_ctx, args.n_audio_state)))
    return args, weights
