"""Paged attention on the host CPU, in numpy: the CPU path (attention backend "host").

MLX's CPU backend evaluates ``exp`` one scalar at a time (about 9 ns per
element on a 2-core x86 machine, 25x numpy's vectorised loop), so a softmax over
the scores, not the matmuls, dominated attention there, and its SDPA copied
strided K/V views before every call. This path reads the paged cache in place
through numpy views of MLX's buffers (no copy until a request's blocks are
taken), batches decode rows into one matmul per KV head group, and splits
long prefill chunks into query blocks that only score keys up to their own
last position (half the causal work skipped). Same contract and answers as
``reference.paged_attention``; float32 only (the CPU runs float32 weights,
and numpy has no bfloat16).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels import reference
from kernels.paged_kv import AttentionMetadata

# Query rows scored at once in a prefill chunk: bounds the [H, rows, keys] score block
# (9 MB at 2K keys and 9 heads) and lets each block skip the keys after its last row.
QUERY_BLOCK = 128


def supported(q: mx.array, k_cache: mx.array) -> bool:
    return q.dtype == mx.float32 and k_cache.dtype == mx.float32


def _softmax_values(
    s: np.ndarray, visible: np.ndarray, v: np.ndarray, softcap: float | None, sinks: np.ndarray | None,
) -> np.ndarray:
    """softmax(s) @ v with hidden keys masked. s [N, Hkv, rows*G, S] (scaled), visible broadcastable
    to it, v [N, Hkv, S, D], sinks [Hkv, rows*G, 1] or None."""
    if softcap is not None:
        np.tanh(s / softcap, out=s)
        s *= softcap
    np.copyto(s, -np.inf, where=~visible)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        np.maximum(m, sinks, out=m)
    s -= m
    np.exp(s, out=s)
    denom = s.sum(-1, keepdims=True)
    if sinks is not None:
        # A sink takes probability mass and contributes no value.
        denom += np.exp(sinks - m)
    s /= denom
    return s @ v


def _context(cache: np.ndarray, table: np.ndarray, length: int) -> np.ndarray:
    """Requests' first ``length`` K (or V) rows through their block tables ``[N, blocks]``: [N, Hkv, length, D].

    Indexing the head-major view takes the blocks in one copy that is already laid out
    for the matmuls (each head's rows contiguous).
    """
    nb, bs, hkv, d = cache.shape
    rows = cache.transpose(2, 0, 1, 3)[:, table]  # [Hkv, N, blocks, bs, D]
    return rows.reshape(hkv, len(table), -1, d)[:, :, :length].transpose(1, 0, 2, 3)


class _Plan:
    """What every layer of a step shares: the decode batch's rows, tables and masks, and the chunks."""

    def __init__(self, meta: AttentionMetadata):
        tables = np.asarray(meta.block_tables)
        bs = meta.block_size
        qlens, slens, cu = meta.query_lens_np, meta.seq_lens_np, meta.cu_seqlens_q_np
        decode = np.flatnonzero(qlens == 1)
        self.decode_rows = cu[decode]
        if len(decode):
            length = int(slens[decode].max())
            self.decode_table = tables[decode, : -(-length // bs)]
            self.decode_len = length
            self.decode_last = (slens[decode] - 1)[:, None]
            self.decode_visible = np.arange(length)[None, :] <= self.decode_last
        self.chunks = [
            (int(cu[b]), int(qlens[b]), int(slens[b]), tables[b : b + 1, : -(-int(slens[b]) // bs)])
            for b in np.flatnonzero(qlens > 1)
        ]


def _plan(meta: AttentionMetadata) -> _Plan:
    # Every layer of a step passes the same metadata (window layers their own): plan once each,
    # kept on the metadata.
    plan = meta.plans.get("numpy")
    if plan is None:
        plan = meta.plans["numpy"] = _Plan(meta)
    return plan


def _sink_rows(sinks: np.ndarray | None, hkv: int, group: int, rows: int) -> np.ndarray | None:
    """sinks [H] laid out to match the score rows [Hkv, rows*G, 1] (head h = kv * G + g)."""
    if sinks is None:
        return None
    return np.broadcast_to(sinks.reshape(hkv, 1, group), (hkv, rows, group)).reshape(hkv, rows * group, 1)


def _decode(qn, kn, vn, plan: _Plan, scale, window, softcap, sinks) -> np.ndarray:
    """All one-token requests as one padded batch: [len(decode), H, D]."""
    _, _, hkv, d = kn.shape
    n, h = len(plan.decode_rows), qn.shape[1]
    g = h // hkv
    k = _context(kn, plan.decode_table, plan.decode_len)
    v = _context(vn, plan.decode_table, plan.decode_len)
    qg = (qn[plan.decode_rows] * scale).reshape(n, hkv, g, d)
    s = qg @ k.swapaxes(-1, -2)  # [n, Hkv, G, S]
    visible = plan.decode_visible
    if window is not None:
        visible = visible & (np.arange(plan.decode_len)[None, :] > plan.decode_last - window)
    out = _softmax_values(s, visible[:, None, None, :], v, softcap, _sink_rows(sinks, hkv, g, 1))
    return out.reshape(n, h, d)


def _chunk(qn, kn, vn, chunk, scale, window, softcap, sinks) -> np.ndarray:
    """One request's new rows over its context, QUERY_BLOCK rows at a time: [query_len, H, D]."""
    _, _, hkv, d = kn.shape
    h = qn.shape[1]
    g = h // hkv
    start, ql, sl, table = chunk
    k = _context(kn, table, sl)[0]  # [Hkv, S, D]
    v = _context(vn, table, sl)[0]
    kt = k.swapaxes(-1, -2)  # [Hkv, D, S]: a transposed view the matmul reads as such
    q = (qn[start : start + ql] * scale).reshape(ql, hkv, g, d).transpose(1, 0, 2, 3)  # [Hkv, ql, G, D]
    out = np.empty((ql, h, d), dtype=qn.dtype)
    first = sl - ql  # absolute position of the chunk's first row
    for a in range(0, ql, QUERY_BLOCK):
        e = min(ql, a + QUERY_BLOCK)
        n = e - a
        end = first + e  # keys past the block's last row are never visible
        lo = 0 if window is None else max(0, first + a - window + 1)
        qb = np.ascontiguousarray(q[:, a:e]).reshape(hkv, n * g, d)
        s = qb @ kt[:, :, lo:end]  # [Hkv, n*G, keys]
        qpos = np.arange(first + a, first + e)[:, None]
        key = np.arange(lo, end)[None, :]
        visible = key <= qpos
        if window is not None:
            visible &= key > qpos - window
        visible = np.repeat(visible, g, axis=0)  # rows are (query, G) pairs
        o = _softmax_values(s[None], visible[None, None], v[None, :, lo:end], softcap,
                            _sink_rows(sinks, hkv, g, n))
        out[a:e] = o[0].reshape(hkv, n, g, d).transpose(1, 0, 2, 3).reshape(n, h, d)
    return out


def paged_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float,
    sliding_window: int | None = None, softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """``reference.paged_attention``'s contract, computed on the host (float32 only: see ``supported``;
    the reference answers other dtypes).

    Evaluates ``q`` and the caches (this layer's inputs) and returns a new array.
    """
    if not supported(q, k_cache):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
    # numpy views of MLX's buffers: the caches are read in place, never copied whole.
    qn, kn, vn = np.asarray(q), np.asarray(k_cache), np.asarray(v_cache)
    plan = _plan(meta)
    sn = None if sinks is None else np.asarray(sinks.astype(mx.float32))
    out = np.empty(qn.shape, dtype=qn.dtype)
    if len(plan.decode_rows):
        out[plan.decode_rows] = _decode(qn, kn, vn, plan, scale, sliding_window, softcap, sn)
    for chunk in plan.chunks:
        start, ql = chunk[0], chunk[1]
        out[start : start + ql] = _chunk(qn, kn, vn, chunk, scale, sliding_window, softcap, sn)
    return mx.array(out)
