"""GGUF files as mlx_lm models.

``read_gguf`` reads the header and tensor table (the data stays memory-mapped),
``gguf_arch`` maps each architecture's metadata and tensor names to its mlx_lm
model, and ``gguf_quant`` turns quantized blocks into MLX quantized weights (kept on a
GPU) or dense float32 (the CPU's policy, ``engined.device.weight_dtype``).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from mlx_lm.utils import _get_classes

from mlxd.shared.errors import ModelLoadError

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


# GGUF value types: fixed-size scalars by struct code (8 = string, 9 = array).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Tensor types whose data gguf.quants reads as typed elements; every other type as raw block bytes.
_ELEMENT_DTYPE = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (the file lists dimensions innermost first)
    data: np.ndarray  # memory-mapped: typed elements in ``shape``, or uint8 block bytes per row


def read_gguf(path: str) -> tuple[dict, dict[str, GGUFTensor]]:
    """(metadata as Python values, tensors by name) of a GGUF file; tensor data stays memory-mapped.

    Every count and offset is checked before it is used, so a truncated or
    corrupt file raises ModelLoadError rather than crashing the process. The
    walk is ours, not ``gguf.GGUFReader``'s: that reader builds a numpy view
    for every part of every string (2.5 s of each start for SmolLM2's
    49K-token vocabulary, three times that for a 151K one); this one decodes
    the same values in a tenth of the time.
    """

    def bad(why: str):
        return ModelLoadError(f"{path}: cannot read GGUF file ({why})")

    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise bad("empty file") from None
    size, pos = len(buf), 0

    def unpack(code: str, count: int = 1) -> tuple:
        nonlocal pos
        n = struct.calcsize(code) * count
        if count < 0 or pos + n > size:
            raise bad("truncated or corrupt header")
        out = struct.unpack_from(f"<{count}{code}", buf, pos)
        pos += n
        return out

    def string() -> str:
        nonlocal pos
        (n,) = unpack("Q")
        if pos + n > size:
            raise bad("truncated or corrupt header")
        pos += n
        try:
            return buf[pos - n : pos].decode("utf-8")
        except UnicodeDecodeError:
            raise bad("a string that is not UTF-8") from None

    def value(kind: int):
        if kind in _SCALAR:
            return unpack(_SCALAR[kind])[0]
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = unpack("I")[0], unpack("Q")[0]
            if count > size:
                raise bad("corrupt array length")
            if inner in _SCALAR:
                return list(unpack(_SCALAR[inner], count))
            if inner == 8:
                return [string() for _ in range(count)]
            raise bad(f"unsupported array element type {inner}")
        raise bad(f"unknown metadata value type {kind}")

    with buf:
        if buf[:4] != b"GGUF":
            raise bad("not a GGUF file")
        pos = 4
        if (version := unpack("I")[0]) not in (2, 3):
            raise bad(f"unsupported GGUF version {version}")
        n_tensors, n_kv = unpack("Q", 2)
        if n_tensors > size or n_kv > size:
            raise bad("corrupt header counts")
        meta = {}
        for _ in range(n_kv):
            key, kind = string(), unpack("I")[0]
            if key in meta:
                raise bad(f"duplicate key {key!r}")
            meta[key] = value(kind)
        alignment = meta.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise bad("bad alignment")
        table = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = unpack("I")
            if not 1 <= n_dims <= 4:
                raise bad(f"tensor {name!r} has {n_dims} dimensions")
            dims = unpack("Q", n_dims)
            table.append((name, tuple(reversed(dims)), unpack("I")[0], unpack("Q")[0]))
        data_start = -(-pos // alignment) * alignment
    data = np.memmap(path, mode="r")
    tensors = {}
    for name, shape, kind, offset in table:
        try:
            kind = GGMLQuantizationType(kind)
            width, nbytes = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise bad(f"tensor {name!r} has unknown type {kind}") from None
        if name in tensors:
            raise bad(f"duplicate tensor {name!r}")
        count = math.prod(shape)
        if count % width or shape[-1] % width or data_start + offset + count // width * nbytes > size:
            raise bad(f"tensor {name!r} lies outside the file")
        raw = data[data_start + offset : data_start + offset + count // width * nbytes]
        if kind in _ELEMENT_DTYPE:
            view = raw.view(_ELEMENT_DTYPE[kind]).reshape(shape)
        else:
            view = raw.reshape(*shape[:-1], shape[-1] // width * nbytes)
        tensors[name] = GGUFTensor(kind, shape, view)
    return meta, tensors


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
    meta, tensors = read_gguf(path)
    arch = meta_value(meta, "general.architecture")
    family = family_of(arch, path)
    shapes = {name: t.shape for name, t in tensors.items()}

    def get(key, default=None):
        return meta_value(meta, f"{arch}.{key}", default)

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        return dense(t.data, t.tensor_type, t.shape)

    config = config_from_metadata(family, get, shapes, path, read)
    values, kinds = {}, set()
    for name, t in tensors.items():
        kind = t.tensor_type
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
