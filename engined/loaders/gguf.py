"""GGUF files as mlx_lm models.

The file is read with the ``gguf`` package (memory-mapped); ``gguf_arch``
maps each architecture's metadata and tensor names to its mlx_lm model, and
``gguf_quant`` turns quantized blocks into MLX quantized weights (kept on a
GPU) or dense float32 (the CPU's policy, ``engined.device.weight_dtype``).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from mlx_lm.utils import _get_classes

from shared.errors import ModelLoadError

from .gguf_arch import config_from_metadata, family_of, mlx_weights
from .gguf_quant import Packed, dense, quantized
from .gguf_tokenizer import build_tokenizer_dir, meta_list, meta_value

_F32 = GGMLQuantizationType.F32


@dataclass
class GGUFModel:
    model: nn.Module
    config: dict
    tokenizer_dir: Path
    eos_token_ids: list[int]
    bos_token_id: int | None
    float_dtype: mx.Dtype  # the precision the file's weight matrices were stored at


def _apply_rope_freqs(model: nn.Module, factors: np.ndarray, config: dict) -> None:
    dims = config["head_dim"]
    base = config["rope_theta"]
    freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * mx.array(factors, dtype=mx.float32)
    for layer in model.model.layers:
        layer.self_attn.rope._freqs = freqs


# GGUF value types -> byte size of fixed-size scalars (8 = string, 9 = array).
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


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
            try:
                width, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except ValueError:
                raise bad(f"tensor {name.decode(errors='replace')!r} has unknown type {kind}") from None
            if count % width or data_start + offset + count // width * nbytes > size:
                raise bad(f"tensor {name.decode(errors='replace')!r} lies outside the file")


def _read(path: str) -> tuple[dict, dict]:
    """(metadata as Python values, tensors by name) of a GGUF file; tensor data stays memory-mapped."""
    try:
        reader = GGUFReader(path)
        meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    except Exception as e:  # the reader raises plain ValueError/KeyError/struct errors on bad files
        raise ModelLoadError(f"{path}: cannot read GGUF file ({e})") from e
    return meta, {t.name: t for t in reader.tensors}


def _file_float(kinds: set) -> mx.Dtype:
    """The float precision a GGUF file's weights were stored at (what its dense tensors run in on a GPU)."""
    if GGMLQuantizationType.BF16 in kinds:
        return mx.bfloat16
    return mx.float32 if kinds <= {_F32} else mx.float16


def _to_mlx(name: str, value) -> dict[str, mx.array]:
    if isinstance(value, Packed):
        prefix = name[: -len(".weight")]
        low = mx.uint8 if value.mode == "mxfp4" else mx.float16  # the GGUF's scales are float16
        out = {f"{prefix}.weight": mx.array(value.weight), f"{prefix}.scales": mx.array(value.scales).astype(low)}
        if value.biases is not None:
            out[f"{prefix}.biases"] = mx.array(value.biases).astype(mx.float16)
        return out
    return {name: mx.array(np.ascontiguousarray(value, dtype=np.float32))}


def load_gguf(path: str | Path, keep_quantized: bool = False) -> GGUFModel:
    """Build the mlx_lm model of a GGUF file, weights evaluated.

    ``keep_quantized``: quantized tensors become MLX quantized layers (see
    ``gguf_quant`` for which types are exact; scales and biases float16, the
    GGUF blocks' own precision); otherwise they are dense. Dense tensors are
    float32, exactly the values ``gguf.quants.dequantize`` gives; the caller
    casts them by its dtype policy (``float_dtype`` is the file's own).
    """
    path = str(path)
    check_gguf_structure(path)
    meta, tensors = _read(path)
    arch = meta_value(meta, "general.architecture")
    family = family_of(arch, path)
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in tensors.items()}

    def get(key, default=None):
        return meta_value(meta, f"{arch}.{key}", default)

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        return dense(t.data, GGMLQuantizationType(int(t.tensor_type)), shapes[name])

    config = config_from_metadata(family, get, shapes, path, read)
    values, kinds = {}, set()
    for name, t in tensors.items():
        kind = GGMLQuantizationType(int(t.tensor_type))
        # only weight matrices become quantized layers; a quantized bias is read dense
        packed = quantized(t.data, kind, shapes[name]) if keep_quantized and name.endswith(".weight") else None
        try:
            values[name] = packed if packed is not None else dense(t.data, kind, shapes[name])
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"{path}: tensor {name!r} of type {kind.name} cannot be read ({e})") from e
        if len(shapes[name]) > 1:
            kinds.add(kind)
    mapped = mlx_weights(family, config, values)
    del values
    quant = {
        name[: -len(".weight")]: {"group_size": v.group_size, "bits": v.bits, "mode": v.mode}
        for name, v in mapped.items()
        if isinstance(v, Packed)
    }
    # Tensor by tensor, so that each host copy is freed once MLX holds it: the peak
    # is the model once plus one tensor, not twice the model.
    weights = {}
    for name in list(mapped):
        weights.update(_to_mlx(name, mapped.pop(name)))

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if quant:
        nn.quantize(model, class_predicate=lambda p, m: quant.get(p, False) if hasattr(m, "to_quantized") else False)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensors do not match the {config['model_type']} architecture ({e})") from e
    if "rope_freqs.weight" in tensors and family.permute_qk:
        _apply_rope_freqs(model, dense(tensors["rope_freqs.weight"].data, GGMLQuantizationType.F32, shapes["rope_freqs.weight"]), config)
    mx.eval(model.parameters())

    tokens = meta_list(meta, "tokenizer.ggml.tokens")
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        idx = meta_value(meta, key)
        if idx is not None and int(idx) not in eos:
            eos.append(int(idx))
    # Chat models converted without an eot id still end turns with their
    # template's end marker; stopping on it is what every chat client expects.
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<turn|>"):
        if marker in tokens and tokens.index(marker) not in eos:
            eos.append(tokens.index(marker))
    bos = meta_value(meta, "tokenizer.ggml.bos_token_id")
    return GGUFModel(
        model=model,
        config=config,
        tokenizer_dir=build_tokenizer_dir(meta, path),
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        float_dtype=_file_float(kinds),
    )
