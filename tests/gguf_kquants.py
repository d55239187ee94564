"""Plain encoders for the K-quant blocks that the `gguf` package can read but not write (Q4_K, Q5_K, Q6_K).

Not llama.cpp's search for the best scales: one min/max pass per sub-block,
enough to make valid blocks whose values ``gguf.quants.dequantize`` then
defines. Tests quantize with these and compare against that dequantization,
so the encoder's quality does not matter, only that its bytes are the format.
"""

from __future__ import annotations

import numpy as np

QK = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes of a Q4_K/Q5_K super-block."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _k_affine(blocks: np.ndarray, levels: int):
    """Per 32-value sub-block: codes, 6-bit scales and mins, and the two super-block factors."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d[:, None])), 0, 63)
        mn = np.clip(np.nan_to_num(np.round(-lo / dmin[:, None])), 0, 63)
        step = (d[:, None] * sc)[..., None]
        codes = np.nan_to_num(np.round((sub + (dmin[:, None] * mn)[..., None]) / step))
    return np.clip(codes, 0, levels).astype(np.uint8), sc, mn, d, dmin


def _low_nibble_chunks(codes: np.ndarray) -> np.ndarray:
    """(n, 8, 32) codes -> 128 bytes: 32-byte chunk c holds sub-block 2c low and 2c+1 high."""
    c = codes.reshape(codes.shape[0], 4, 2, 32) & 0x0F
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, QK).astype(np.float32)
    codes, sc, mn, d, dmin = _k_affine(blocks, 15)
    out = np.concatenate([_f16(d), _f16(dmin), _pack_k_scales(sc, mn), _low_nibble_chunks(codes)], axis=1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, QK).astype(np.float32)
    codes, sc, mn, d, dmin = _k_affine(blocks, 31)
    # byte i of qh: bit j is the fifth bit of value i of sub-block j
    high = (codes >> 4).transpose(0, 2, 1)  # (n, 32, 8)
    qh = np.packbits(high, axis=-1, bitorder="little").reshape(-1, 32)
    out = np.concatenate([_f16(d), _f16(dmin), _pack_k_scales(sc, mn), qh, _low_nibble_chunks(codes)], axis=1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, QK).astype(np.float32)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = peak / -32
    d = (np.abs(scale).max(-1) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d[:, None])), -127, 127)
        step = (d[:, None] * sc)[..., None]
        q = np.nan_to_num(np.round(sub / step))
    codes = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # halves of 128 values
    ql = (codes[:, :, :64] & 0x0F) | ((codes[:, :, 64:] & 0x0F) << 4)  # (n, 2, 64)
    hi = (codes >> 4).reshape(n, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # (n, 2, 32)
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1)
    return out.reshape(*x.shape[:-1], -1)


ENCODERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
