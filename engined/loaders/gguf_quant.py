"""GGUF tensors as MLX arrays: dense float32, or MLX quantized weights of the nearest format.

A GGUF quantized row is a run of blocks; every type listed here splits a
block into groups of 32 values with one scale and one offset each, which is
exactly MLX's affine quantization with ``group_size=32``:

=======  ===========================  ===================================
GGUF     MLX                          values
=======  ===========================  ===================================
Q4_0     4-bit, scale d, bias -8d     exact
Q4_1     4-bit, scale d, bias m       exact
Q5_0     5-bit, scale d, bias -16d    exact
Q5_1     5-bit, scale d, bias m       exact
Q8_0     8-bit, scale d, bias -128d   exact
Q4_K     4-bit, scale d*sc, bias      exact codes; d*sc and dmin*m are
         -dmin*m                      rounded once to the scales' dtype
Q5_K     5-bit, likewise              likewise
Q6_K     8-bit (re-quantized)         its 16-wide sub-blocks have no MLX
                                      group size; per 32 at 8 bits the
                                      added error is <= half a step
                                      (the group's range / 510)
MXFP4    mxfp4                        exact (same e8m0 scale and e2m1 code)
=======  ===========================  ===================================

F32/F16/BF16 stay dense, and so do other types (Q2_K, Q3_K, IQ*, TQ*):
dequantized, they run at the model's float dtype. Scales and biases are
returned in float32 so that the caller decides their precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

_FLOAT = {T.F32, T.F16, T.BF16}
_QK = 256  # K-quant super-block


@dataclass
class Packed:
    """One tensor in MLX's quantized layout (numpy; rows on the leading axes, groups along the last)."""

    weight: np.ndarray  # uint32, (..., in * bits / 32)
    scales: np.ndarray  # float32 (affine) or uint8 (mxfp4), (..., in / 32)
    biases: np.ndarray | None  # float32, (..., in / 32); None for mxfp4
    bits: int
    mode: str = "affine"
    group_size: int = 32

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (unpacked) shape."""
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)


Value = np.ndarray | Packed


def dense(data: np.ndarray, kind: T, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's values as float32, in numpy order ``shape``."""
    return np.asarray(quants.dequantize(data, kind), dtype=np.float32).reshape(shape)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes (..., n) -> MLX's packing: a little-endian bit stream per row, read as uint32.

    ``bits``: 4, 5 or 8, the widths the GGUF types map to.
    """
    lead, n = codes.shape[:-1], codes.shape[-1]
    c = np.ascontiguousarray(codes, np.uint8)
    if bits == 8:
        packed = c
    elif bits == 4:
        packed = c[..., 0::2] | (c[..., 1::2] << 4)
    elif bits == 5:
        # 8 codes -> 5 bytes (uint8 shifts drop the bits that belong to the next byte)
        k = [c[..., i::8] for i in range(8)]
        packed = np.stack(
            [k[0] | (k[1] << 5), (k[1] >> 3) | (k[2] << 2) | (k[3] << 7), (k[3] >> 1) | (k[4] << 4),
             (k[4] >> 4) | (k[5] << 1) | (k[6] << 6), (k[6] >> 2) | (k[7] << 3)],
            axis=-1,
        )
    else:
        raise ValueError(f"no packing for {bits}-bit codes")
    return np.ascontiguousarray(packed).reshape(*lead, n * bits // 8).view(np.uint32)


def _blocks(data: np.ndarray, kind: T, shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """(the tensor's blocks, one per row of bytes; its number of rows)."""
    return data.reshape(-1, quants.GGML_QUANT_SIZES[kind][1]), int(np.prod(shape[:-1]))


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes of 16 -> 32 codes: low nibbles first, then high (the ggml order of Q4_0/Q4_1/Q5_x)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """``count`` single bits per block, little-endian over the bytes of ``qh``."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block, from their 12 packed bytes."""
    d, m, md = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _affine(kind: T, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(codes per value, scale per 32, bias per 32, bits) of n blocks ``b`` (n, block bytes)."""
    n = b.shape[0]
    if kind == T.Q8_0:
        d = _f16(b[:, :2])
        return (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d, 8
    if kind in (T.Q4_0, T.Q4_1):
        d = _f16(b[:, :2])
        bias = -8 * d if kind == T.Q4_0 else _f16(b[:, 2:4])
        return _nibbles(b[:, 2 if kind == T.Q4_0 else 4 :]), d, bias, 4
    if kind in (T.Q5_0, T.Q5_1):
        d = _f16(b[:, :2])
        at = 2 if kind == T.Q5_0 else 4
        bias = -16 * d if kind == T.Q5_0 else _f16(b[:, 2:4])
        codes = _nibbles(b[:, at + 4 :]) | (_high_bits(b[:, at : at + 4], 32) << 4)
        return codes, d, bias, 5
    if kind in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        if kind == T.Q4_K:
            qs, bits = b[:, 16:], 4
            high = 0
        else:
            qh, qs, bits = b[:, 16:48], b[:, 48:], 5
            # bit j of byte i is the fifth bit of value i of sub-block j
            high = np.unpackbits(qh[:, :, None], axis=-1, bitorder="little").transpose(0, 2, 1)
        # 32 bytes hold sub-blocks 2c (low nibbles) and 2c+1 (high nibbles)
        chunks = qs.reshape(n, 4, 32)
        codes = np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 8, 32) | (high << 4 if bits == 5 else 0)
        return codes.reshape(n, _QK), (d * sc).reshape(n, 8), (-dmin * mn).reshape(n, 8), bits
    raise KeyError(kind)


_AFFINE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K}
_REQUANTIZED = {T.Q6_K: 8}


def _mxfp4(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # ggml's kvalues table lists e2m1 in code order, doubled with a halved scale: the
    # same byte is MLX's e8m0 scale and the same nibble its code, only reordered.
    return _nibbles(b[:, 1:]), np.ascontiguousarray(b[:, 0])


def quantized(data: np.ndarray, kind: T, shape: tuple[int, ...]) -> Packed | None:
    """The tensor in MLX's quantized layout, or None when it is not kept quantized (floats, other types)."""
    if kind in _FLOAT or len(shape) < 2:
        return None
    if kind in _AFFINE:
        b, rows = _blocks(data, kind, shape)
        codes, scales, biases, bits = _affine(kind, b)
        lead = shape[:-1]
        return Packed(
            weight=pack_codes(codes.reshape(rows, shape[-1]), bits).reshape(*lead, -1),
            scales=scales.reshape(*lead, -1),
            biases=biases.reshape(*lead, -1),
            bits=bits,
        )
    if kind == T.MXFP4:
        b, rows = _blocks(data, kind, shape)
        codes, scales = _mxfp4(b)
        lead = shape[:-1]
        return Packed(pack_codes(codes.reshape(rows, shape[-1]), 4).reshape(*lead, -1), scales.reshape(*lead, -1), None, 4, "mxfp4")
    if kind in _REQUANTIZED and shape[-1] % 32 == 0:
        return requantize(dense(data, kind, shape), _REQUANTIZED[kind])
    return None


def requantize(x: np.ndarray, bits: int) -> Packed:
    """Round-to-nearest affine quantization per 32 values, min to max (error <= half a step)."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    lo, hi = groups.min(-1), groups.max(-1)
    step = (hi - lo) / ((1 << bits) - 1)
    safe = np.where(step > 0, step, 1.0)
    codes = np.clip(np.round((groups - lo[..., None]) / safe[..., None]), 0, (1 << bits) - 1).astype(np.uint8)
    return Packed(pack_codes(codes.reshape(x.shape), bits), step.astype(np.float32), lo.astype(np.float32), bits)


def unpack(p: Packed) -> np.ndarray:
    """float32 values of a Packed tensor (for layout changes that cut across quantization groups)."""
    import mlx.core as mx

    biases = None if p.biases is None else mx.array(p.biases)
    return np.array(
        mx.dequantize(mx.array(p.weight), mx.array(p.scales), biases, group_size=p.group_size, bits=p.bits, mode=p.mode)
        .astype(mx.float32)
    )


def _codes(p: Packed) -> np.ndarray:
    """The uint8 codes of an affine Packed tensor (inverse of pack_codes)."""
    raw = np.ascontiguousarray(p.weight).view(np.uint8).reshape(-1, p.bits)
    eight = np.zeros((raw.shape[0], 8), np.uint8)
    eight[:, : p.bits] = raw
    stream = eight.view(np.uint64)[:, 0]
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(p.bits)
    codes = (stream[:, None] >> shifts) & np.uint64((1 << p.bits) - 1)
    return codes.astype(np.uint8).reshape(p.shape)


def _widen(p: Packed, bits: int) -> Packed:
    # A b-bit affine group is exactly a wider one with the same scale, bias and codes.
    if p.bits == bits:
        return p
    return Packed(pack_codes(_codes(p), bits), p.scales, p.biases, bits)


def _each(p: Packed, fn) -> Packed:
    return Packed(fn(p.weight), fn(p.scales), None if p.biases is None else fn(p.biases), p.bits, p.mode)


def take_rows(v: Value, idx: np.ndarray) -> Value:
    """Rows ``idx`` of a weight (its output axis, -2) or of a 1-D tensor; quantized rows move whole."""
    if isinstance(v, Packed):
        return _each(v, lambda a: np.take(a, idx, axis=-2))
    return v[idx] if v.ndim == 1 else np.take(v, idx, axis=-2)


def cat_rows(vs: list[Value]) -> Value:
    """Stack weights along their output axis; quantized parts of different widths meet at the widest."""
    if all(isinstance(v, Packed) and v.mode == "affine" for v in vs):
        bits = max(v.bits for v in vs)
        wide = [_widen(v, bits) for v in vs]
        return Packed(*(np.concatenate([getattr(w, f) for w in wide], axis=-2) for f in ("weight", "scales", "biases")), bits)
    dense_parts = [unpack(v) if isinstance(v, Packed) else v for v in vs]
    return np.concatenate(dense_parts, axis=-2)


def permute_cols(v: Value, order: np.ndarray, width: int) -> Value:
    """Reorder the input axis in units of ``width`` columns (unit ``order[i]`` goes to place i).

    Quantized weights move whole groups when ``width`` is a multiple of the
    group size; otherwise the tensor is returned dense (float32).
    """
    if isinstance(v, Packed) and width % v.group_size == 0:
        units = len(order)

        def move(a: np.ndarray) -> np.ndarray:
            return a.reshape(*a.shape[:-1], units, -1)[..., order, :].reshape(a.shape)

        return _each(v, move)
    d = unpack(v) if isinstance(v, Packed) else v
    return d.reshape(*d.shape[:-1], len(order), width)[..., order, :].reshape(d.shape)
