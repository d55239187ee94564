"""The paged KV layout every implementation shares, and the attention over it that needs no GPU kernel.

The layout: the step's ``AttentionMetadata`` (built once per step on the host,
read by every layer) and ``write_kv``, which puts the step's new K/V into their
slots.

``reference_attention``, in pure MLX: the oracle every implementation is
tested against, and the fallback for what the others do not cover (half
precision on the CPU, sinks on a GPU). Decode rows (one query token) are
gathered into one padded batch and run as a single attention call; each
prefill chunk runs on its own with a causal mask offset by its cached
context. Nothing is padded across prefill chunks.

``host_attention``, in numpy, is the CPU path (attention backend "host").
MLX's CPU backend evaluates ``exp`` one scalar at a time (about 9 ns per
element on a 2-core x86 machine, 25x numpy's vectorised loop), so a softmax over
the scores, not the matmuls, dominated attention there, and its SDPA copied
strided K/V views before every call. This path reads the paged cache in place
through numpy views of MLX's buffers (no copy until a request's blocks are
taken), batches decode rows into one matmul per KV head group, and splits
long prefill chunks into query blocks that only score keys up to their own
last position (half the causal work skipped). Same contract and answers as
``reference_attention``; float32 only (the CPU runs float32 weights,
and numpy has no bfloat16).

Over 400 lines because the layout and the two implementations that need no GPU kernel are one
contract: the oracle and the CPU path read the layout as the kernels do, and each is checked
against the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


TABLE_WIDTH_STEP = 8  # block tables are this many blocks wide or a multiple of it


@dataclass(frozen=True)
class AttentionMetadata:
    """The packed batch's layout, as device arrays (for kernels) and host arrays (for planning).

    Request ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of the
    packed ``q [T, H, D]``; its context after this step is ``seq_lens[b]`` tokens,
    of which the last ``query_lens[b]`` are this step's. ``block_tables[b]``
    lists its physical blocks (padded with 0); ``slot_mapping[t]`` is where row
    ``t``'s K/V goes in the flattened ``[num_blocks * block_size]`` cache.

    ``plans`` holds what an implementation derives from the metadata once and
    every layer of the step reuses (its launch plan); it lives and dies with
    the metadata, so no cache outside it has to guess when a step is over.
    """

    cu_seqlens_q: mx.array  # [B + 1] int32
    seq_lens: mx.array  # [B] int32
    block_tables: mx.array  # [B, max_blocks] int32
    slot_mapping: mx.array  # [T] int32
    positions: mx.array  # [T] int32, absolute position of each row
    query_lens_np: np.ndarray  # [B] host copy
    seq_lens_np: np.ndarray  # [B] host copy
    cu_seqlens_q_np: np.ndarray  # [B + 1] host copy
    block_size: int
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens_q_np[-1])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_np)

    @classmethod
    def build(
        cls, query_lens: list[int] | np.ndarray, seq_lens: list[int] | np.ndarray,
        block_tables: list[list[int]], block_size: int,
    ) -> "AttentionMetadata":
        """Derive every array from the per-request query lengths, context lengths and block lists."""
        q = np.asarray(query_lens, dtype=np.int32)
        s = np.asarray(seq_lens, dtype=np.int32)
        assert q.shape == s.shape and (q >= 1).all() and (s >= q).all()
        cu = np.zeros(len(q) + 1, dtype=np.int32)
        np.cumsum(q, out=cu[1:])
        # Rounded up so that a decode step's arrays keep their shapes while contexts grow
        # (engined/fastpath/compiled_decode.py replays one graph per shape); entries past a table are never read.
        longest = max((len(t) for t in block_tables), default=0)
        width = max(-(-longest // TABLE_WIDTH_STEP), 1) * TABLE_WIDTH_STEP
        table = np.zeros((len(q), width), dtype=np.int32)
        for b, blocks in enumerate(block_tables):
            table[b, : len(blocks)] = blocks
        # Position of every packed row, then its slot through its request's table.
        req = np.repeat(np.arange(len(q)), q)
        pos = np.arange(cu[-1], dtype=np.int32) - np.repeat(cu[:-1], q) + np.repeat(s - q, q)
        slots = table[req, pos // block_size] * block_size + pos % block_size
        return cls(
            cu_seqlens_q=mx.array(cu),
            seq_lens=mx.array(s),
            block_tables=mx.array(table),
            slot_mapping=mx.array(slots.astype(np.int32)),
            positions=mx.array(pos.astype(np.int32)),
            query_lens_np=q,
            seq_lens_np=s,
            cu_seqlens_q_np=cu,
            block_size=block_size,
        )


def write_kv(
    k_cache: mx.array, v_cache: mx.array, k: mx.array, v: mx.array, meta: AttentionMetadata
) -> tuple[mx.array, mx.array]:
    """Scatter new rows ``k, v [T, H_kv, D]`` into the caches at ``meta.slot_mapping``; returns the new caches,
    which are also what ``k_cache`` and ``v_cache`` now hold (MLX's indexed assignment replaces them).

    Indexed by (block, offset in it), split once per step for every layer: scattering into the flattened
    cache would cost each layer four reshapes more, on a step bound by the host's cost per operation.
    """
    bs = k_cache.shape[1]
    where = meta.plans.get(("write", bs))
    if where is None:
        where = meta.plans["write", bs] = (meta.slot_mapping // bs, meta.slot_mapping % bs)
    blocks, offsets = where
    k_cache[blocks, offsets] = k.astype(k_cache.dtype)
    v_cache[blocks, offsets] = v.astype(v_cache.dtype)
    return k_cache, v_cache


def in_packed_order(pieces: list[mx.array], rows: list[np.ndarray], num_tokens: int) -> mx.array:
    """Concatenate ``pieces`` (rows ``rows[i]`` of the packed batch each) into packed order.

    No gather when they already are in order (e.g. decode rows ahead of the chunks).
    """
    packed = mx.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]
    at = np.concatenate(rows)
    if (np.diff(at) > 0).all():
        return packed
    inverse = np.empty(num_tokens, dtype=np.int32)
    inverse[at] = np.arange(num_tokens, dtype=np.int32)
    return packed[mx.array(inverse)]


# The reference: pure MLX.


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


def reference_attention(
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
    """The requests ``decode`` (one new token each) as one padded batch: ``[len(decode), H, D]``.

    A step of decode rows only reads every table whole and its lengths on the device: its graph then
    takes nothing from the host but its arrays' shapes, and can be replayed (``replay_key``).
    """
    slens, cu = meta.seq_lens_np, meta.cu_seqlens_q_np
    if len(decode) == meta.num_tokens:
        tables, qd, last = meta.block_tables, q, meta.seq_lens - 1
        length = tables.shape[1] * meta.block_size
    else:
        idx = mx.array(decode.astype(np.int32))
        tables, qd = meta.block_tables[idx], q[mx.array(cu[decode].astype(np.int32))]
        last, length = mx.array(slens[decode] - 1), int(slens[decode].max())
    k = _gather_context(k_cache, tables, length)
    v = _gather_context(v_cache, tables, length)
    qd = qd[:, :, None, :]  # [Bd, H, 1, D]
    key_pos = mx.arange(length)[None, :]
    last = last[:, None]
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


# The host path: numpy.

# Query rows scored at once in a prefill chunk: bounds the [H, rows, keys] score block
# (9 MB at 2K keys and 9 heads) and lets each block skip the keys after its last row.
QUERY_BLOCK = 128


def host_supported(q: mx.array, k_cache: mx.array) -> bool:
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


def host_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float,
    sliding_window: int | None = None, softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """``reference_attention``'s contract, computed on the host (float32 only: see ``host_supported``;
    the reference answers other dtypes).

    Evaluates ``q`` and the caches (this layer's inputs) and returns a new array.
    """
    if not host_supported(q, k_cache):
        return reference_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
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
