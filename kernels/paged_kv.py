"""The paged KV layout every implementation shares: the step's ``AttentionMetadata`` (built once per
step on the host, read by every layer) and ``write_kv``, which puts the step's new K/V into their slots."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


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
        width = max((len(t) for t in block_tables), default=1) or 1
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
    k_cache: mx.array, v_cache: mx.array, k: mx.array, v: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """Scatter new rows ``k, v [T, H_kv, D]`` into the caches at ``slot_mapping``; returns the new caches."""
    nb, bs, hkv, d = k_cache.shape
    kf = k_cache.reshape(nb * bs, hkv, d)
    vf = v_cache.reshape(nb * bs, hkv, d)
    kf[slot_mapping] = k.astype(kf.dtype)
    vf[slot_mapping] = v.astype(vf.dtype)
    return kf.reshape(nb, bs, hkv, d), vf.reshape(nb, bs, hkv, d)


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
