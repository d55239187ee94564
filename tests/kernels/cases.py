"""Random paged batches and a dense oracle, shared by the kernel tests and the device benchmark.

A case scatters each request's contiguous K/V into shuffled physical blocks,
so every implementation must follow the block table; the oracle answers from
the contiguous copies, padded to one batch, never from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxd.engined.kernels.paged_kv import AttentionMetadata


@dataclass
class Case:
    q: mx.array  # [T, H, D]
    k_cache: mx.array  # [num_blocks, block_size, H_kv, D]
    v_cache: mx.array
    meta: AttentionMetadata
    k_dense: list[np.ndarray]  # per request [seq_len, H_kv, D] float32
    v_dense: list[np.ndarray]
    scale: float


def make_case(
    rng: np.random.Generator, query_lens: list[int], seq_lens: list[int], num_heads: int,
    num_kv_heads: int, head_dim: int, block_size: int, dtype=mx.float32, spare_blocks: int = 3,
    shuffle: bool = True,
) -> Case:
    """Random q/K/V for requests with the given new-token and total context lengths; their
    blocks scattered over the pool, or (``shuffle=False``) in order as a fresh pool hands them out."""
    blocks_per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per) + spare_blocks
    perm = rng.permutation(num_blocks) if shuffle else np.arange(num_blocks)
    tables, start = [], 0
    for n in blocks_per:
        tables.append([int(x) for x in perm[start : start + n]])
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Unused slots hold large values: reading one shows up as a wrong answer.
    k_cache = np.full(shape, 1e3, dtype=np.float32)
    v_cache = np.full(shape, -1e3, dtype=np.float32)
    k_dense, v_dense = [], []
    for table, s in zip(tables, seq_lens):
        k = rng.standard_normal((s, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((s, num_kv_heads, head_dim)).astype(np.float32)
        k = np.asarray(mx.array(k).astype(dtype).astype(mx.float32))  # what the cache will hold
        v = np.asarray(mx.array(v).astype(dtype).astype(mx.float32))
        pos = np.arange(s)
        k_cache[np.asarray(table)[pos // block_size], pos % block_size] = k
        v_cache[np.asarray(table)[pos // block_size], pos % block_size] = v
        k_dense.append(k)
        v_dense.append(v)
    t = int(sum(query_lens))
    q = rng.standard_normal((t, num_heads, head_dim)).astype(np.float32)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    return Case(
        q=mx.array(q).astype(dtype),
        k_cache=mx.array(k_cache).astype(dtype),
        v_cache=mx.array(v_cache).astype(dtype),
        meta=meta,
        k_dense=k_dense,
        v_dense=v_dense,
        scale=head_dim ** -0.5,
    )


def dense_attention(case: Case, sliding_window: int | None = None, softcap: float | None = None) -> mx.array:
    """The oracle: every request padded to one dense batch, float32, masked; returns packed [T, H, D].

    Without softcap it is ``mx.fast.scaled_dot_product_attention``; with softcap
    (which SDPA lacks) the same padded batch goes through explicit float32 math.
    """
    meta = case.meta
    qlens, slens, cu = meta.query_lens_np, meta.seq_lens_np, meta.cu_seqlens_q_np
    b, (_, h, d) = len(qlens), case.q.shape
    hkv = case.k_dense[0].shape[1]
    qmax, lmax = int(qlens.max()), int(slens.max())
    q = np.zeros((b, h, qmax, d), np.float32)
    k = np.zeros((b, hkv, lmax, d), np.float32)
    v = np.zeros((b, hkv, lmax, d), np.float32)
    mask = np.zeros((b, 1, qmax, lmax), bool)
    qf = np.asarray(case.q.astype(mx.float32))
    for i in range(b):
        ql, sl = int(qlens[i]), int(slens[i])
        q[i, :, :ql] = qf[cu[i] : cu[i] + ql].transpose(1, 0, 2)
        k[i, :, :sl] = case.k_dense[i].transpose(1, 0, 2)
        v[i, :, :sl] = case.v_dense[i].transpose(1, 0, 2)
        qpos = np.arange(sl - ql, sl)[:, None]
        kpos = np.arange(lmax)[None, :]
        allowed = (kpos <= qpos) & (kpos < sl)
        if sliding_window is not None:
            allowed &= kpos > qpos - sliding_window
        mask[i, 0, :ql] = allowed
    mask[:, :, :, 0] |= ~mask.any(axis=-1)  # padded query rows: any finite row, discarded below
    qm, km, vm, mm = mx.array(q), mx.array(k), mx.array(v), mx.array(mask)
    if softcap is None:
        out = mx.fast.scaled_dot_product_attention(qm, km, vm, scale=case.scale, mask=mm)
    else:
        rep = h // hkv
        kr, vr = mx.repeat(km, rep, axis=1), mx.repeat(vm, rep, axis=1)
        s = (qm * case.scale) @ kr.swapaxes(-1, -2)
        s = mx.tanh(s / softcap) * softcap
        s = mx.where(mm, s, -mx.inf)
        out = mx.softmax(s, axis=-1) @ vr
    out = np.asarray(out)
    rows = [out[i, :, : int(qlens[i])].transpose(1, 0, 2) for i in range(b)]
    return mx.array(np.concatenate(rows, axis=0))


def rel_error(out: mx.array, ref: mx.array) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if ``out`` has any)."""
    a = np.asarray(out.astype(mx.float32), dtype=np.float64)
    r = np.asarray(ref.astype(mx.float32), dtype=np.float64)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - r) / np.linalg.norm(r))


def host_gather_runs(dialect, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, layout):
    """What the GPU gather kernel writes, following its addressing (``source.GATHER_BODY``) row by
    row on the host: the CPU tests and the device script's dry run check the plan that feeds it.
    Rows the layout leaves unwritten stay NaN, so an SDPA run that reads one fails its check, except
    a padded layout's, which the kernel's launch fills with zeros first."""
    _, bs, hkv, d = k_cache.shape
    caches = [np.array(c.astype(mx.float32)) for c in (k_cache, v_cache)]
    tables = np.array(meta.block_tables)
    dst = np.array(layout.dst).reshape(-1, 3)
    outs = [np.full((layout.rows, d), 0.0 if layout.padded else np.nan, dtype=np.float32) for _ in caches]
    for c, j in np.array(layout.work).reshape(-1, 2):
        base, stride, length = dst[c]
        t = j * bs + np.arange(bs)
        t = t[t < length]
        for h in range(hkv):
            for out, cache in zip(outs, caches):
                out[base + h * stride + t] = cache[tables[c, j], t % bs, h]
    return tuple(mx.array(o).astype(k_cache.dtype) for o in outs)
