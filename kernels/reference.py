"""Pure-MLX paged attention: the oracle every implementation is tested against, and the
fallback for what the others do not cover (half precision on the CPU, sinks on a GPU).

Decode rows (one query token) are gathered into one padded batch and run as a
single attention call; each prefill chunk runs on its own with a causal mask
offset by its cached context. Nothing is padded across prefill chunks.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels.paged_kv import AttentionMetadata, in_packed_order


def _attend(q, k, v, mask, scale, softcap, sinks=None):
    """q [B, H, Lq, D], k/v [B, H_kv, Lk, D], boolean mask broadcastable to [B, H, Lq, Lk], sinks [H]."""
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, h // hkv, lq, d)
    scores = (qg * scale) @ k[:, :, None].swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    scores = mx.where(mask[:, :, None], scores, mx.finfo(scores.dtype).min).astype(mx.float32)
    if sinks is not None:
        # A sink is one more logit in each head's softmax that attends to nothing.
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, hkv, h // hkv, 1, 1), (b, hkv, h // hkv, lq, 1))
        probs = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1)[..., 1:].astype(v.dtype)
    else:
        probs = mx.softmax(scores, axis=-1).astype(v.dtype)
    return (probs @ v[:, :, None]).reshape(b, h, lq, d)


def _gather_context(cache: mx.array, tables: mx.array, length: int) -> mx.array:
    """[B, max_blocks] block ids -> [B, H_kv, length, D] contiguous context."""
    nb, bs, hkv, d = cache.shape
    blocks = -(-length // bs)
    ctx = cache[tables[:, :blocks]].reshape(tables.shape[0], blocks * bs, hkv, d)
    return ctx[:, :length].transpose(0, 2, 1, 3)


def paged_attention(
    q: mx.array,
    k_cache: mx.array,
    v_cache: mx.array,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of packed queries ``q [T, H, D]`` over each request's paged context.

    Row ``i`` of request ``b`` sits at absolute position
    ``seq_lens[b] - query_lens[b] + i`` and sees keys at positions ``<=`` its own
    (and, with ``sliding_window = w``, ``> pos - w``). GQA maps head ``h`` to
    KV head ``h // (H // H_kv)``. ``sinks [H]`` (gpt_oss's attention sinks), if
    given, add ``exp(sinks[h])`` to head ``h``'s softmax denominator: a logit
    that takes probability mass and contributes no value. Returns ``[T, H, D]``
    in ``q``'s dtype.
    """
    qlens, cu = meta.query_lens_np, meta.cu_seqlens_q_np
    pieces: list[mx.array] = []
    rows: list[np.ndarray] = []
    decode = np.flatnonzero(qlens == 1)
    if len(decode):
        pieces.append(decode_rows(q, k_cache, v_cache, meta, decode, scale, sliding_window, softcap, sinks))
        rows.append(cu[decode])
    for b in np.flatnonzero(qlens > 1):
        pieces.append(prefill_chunk(q, k_cache, v_cache, meta, int(b), scale, sliding_window, softcap, sinks))
        rows.append(np.arange(cu[b], cu[b] + qlens[b]))
    return in_packed_order(pieces, rows, meta.num_tokens)


def decode_rows(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, decode: np.ndarray,
    scale: float, sliding_window: int | None, softcap: float | None, sinks: mx.array | None = None,
) -> mx.array:
    """The requests ``decode`` (one new token each) as one padded batch: ``[len(decode), H, D]``."""
    slens, cu = meta.seq_lens_np, meta.cu_seqlens_q_np
    idx = mx.array(decode.astype(np.int32))
    length = int(slens[decode].max())
    k = _gather_context(k_cache, meta.block_tables[idx], length)
    v = _gather_context(v_cache, meta.block_tables[idx], length)
    rows = mx.array(cu[decode].astype(np.int32))
    qd = q[rows][:, :, None, :]  # [Bd, H, 1, D]
    key_pos = mx.arange(length)[None, :]
    last = mx.array(slens[decode] - 1)[:, None]
    mask = key_pos <= last
    if sliding_window is not None:
        mask = mask & (key_pos > last - sliding_window)
    return _attend(qd, k, v, mask[:, None, None, :], scale, softcap, sinks)[:, :, 0, :]


def prefill_chunk(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, b: int,
    scale: float, sliding_window: int | None, softcap: float | None, sinks: mx.array | None = None,
) -> mx.array:
    """Request ``b``'s chunk of new rows over its whole context: ``[query_len, H, D]``."""
    start, ql, sl = int(meta.cu_seqlens_q_np[b]), int(meta.query_lens_np[b]), int(meta.seq_lens_np[b])
    k = _gather_context(k_cache, meta.block_tables[b : b + 1], sl)
    v = _gather_context(v_cache, meta.block_tables[b : b + 1], sl)
    qp = q[start : start + ql].transpose(1, 0, 2)[None]  # [1, H, ql, D]
    if sliding_window is None and softcap is None:
        # MLX's causal mask is aligned to the last key, which is exactly a chunk after
        # cached context; the named mask also lets SDPA take its fused (flash) path.
        out = mx.fast.scaled_dot_product_attention(qp, k, v, scale=scale, mask="causal", sinks=sinks)
    else:
        q_pos = mx.arange(sl - ql, sl)[:, None]
        key_pos = mx.arange(sl)[None, :]
        mask = key_pos <= q_pos
        if sliding_window is not None:
            mask = mask & (key_pos > q_pos - sliding_window)
        out = _attend(qp, k, v, mask[None, None], scale, softcap, sinks)
    return out[0].transpose(1, 0, 2)
