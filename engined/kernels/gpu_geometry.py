"""The custom GPU kernel's geometry: which shapes it takes, its tile and decode-group sizes, and the
shared memory they need per dialect (Metal's 32 KB, CUDA's dynamic shared memory), decided from
the head size, the GQA group and a step's longest decode context alone.

``engined.kernels.gpu`` plans and launches the kernel with these numbers; ``bench/kernels/cuda_check.py``
sweeps the tunables here (lanes per token, unroll, partition size, where decode accumulators wait).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from mlxd.engined.kernels import source
from mlxd.engined.kernels.paged_kv import AttentionMetadata

HEAD_DIMS = (64, 80, 96, 128, 256)
# Threadgroup memory a Metal thread group may use; CUDA takes dynamic shared memory up to this.
SHARED_BYTES = {"metal": 32 * 1024, "cuda": 160 * 1024}
# Block-table entries a decode partition stages in shared memory.
TABLE_SLOTS = {"metal": 256, "cuda": 512}
PARTITION_TOKENS = 512  # KV tokens per decode partition before the table limit stretches it
SUBCHUNK = {"metal": 256, "cuda": 512}  # keys whose scores a decode group holds in shared memory at once
ROW_REGISTERS = 64  # query-head elements per lane on the decode path (q and the accumulators each)
# Decode accumulators wait in shared memory while a group computes scores: fewer registers
# per thread, so more groups (and more loads in flight) per multiprocessor.
DECODE_ACC_SHARED = True
NT = source.NUM_THREADS
NW = NT // 32


def tile_shape(dialect: str, head_dim: int) -> tuple[int, int]:
    """(rows, keys) of the prefill score tile: rows = query tokens x GQA heads."""
    if dialect == "cuda":
        return 32, 32
    # Metal's 32 KB: fewer rows for the wide heads.
    if head_dim <= 128:
        return 16, 32
    return 8, 16


def lanes_per_token(head_dim: int) -> int:
    """Lanes sharing one KV row in the decode path: 8 elements (16 bytes of fp16) per lane where possible."""
    return {64: 8, 80: 16, 96: 16, 128: 16, 256: 32}[head_dim]


def decode_unroll(lanes: int) -> int:
    """K (or V) rows each lane group loads per decode step before using them: bytes in flight."""
    return 8


def tile_floats(dialect: str, head_dim: int) -> int:
    rt, bn = tile_shape(dialect, head_dim)
    return head_dim * (rt + 4) + head_dim * (bn + 1) + rt * (bn + 1) + 2 * rt


def row_floats(dialect: str, head_dim: int, heads: int) -> int:
    acc = heads * head_dim // lanes_per_token(head_dim) * NT if DECODE_ACC_SHARED else 0
    return 4 * heads + max(heads * SUBCHUNK[dialect], NW * heads * head_dim) + acc


def row_heads(dialect: str, head_dim: int, group: int) -> int:
    """Query heads one decode group serves (a divisor of the GQA group): as many as fit in
    registers and shared memory, so K/V are read once per group of them."""
    el = head_dim // lanes_per_token(head_dim)
    limit = (SHARED_BYTES[dialect] // 4) - TABLE_SLOTS[dialect]
    for gh in range(group, 0, -1):
        if group % gh == 0 and (gh * el <= ROW_REGISTERS or gh == 1) and row_floats(dialect, head_dim, gh) <= limit:
            return gh
    return 1


def shared_floats(dialect: str, head_dim: int, group: int, rows: bool = True, tiles: bool = True) -> int:
    need = 0
    if rows:
        need = row_floats(dialect, head_dim, row_heads(dialect, head_dim, group))
    if tiles:
        need = max(need, tile_floats(dialect, head_dim))
    return need


def supported(dialect: str, q: mx.array, k_cache: mx.array) -> bool:
    # Asked by every layer of every step with the same few shapes: decided once per shape.
    _, h, d = q.shape
    _, _, hkv, kd = k_cache.shape
    return _supported(dialect, h, d, hkv, kd)


@lru_cache(maxsize=None)
def _supported(dialect: str, h: int, d: int, hkv: int, kd: int) -> bool:
    if d not in HEAD_DIMS or h % hkv or kd != d:
        return False
    g = h // hkv
    rt, bn = tile_shape(dialect, d)
    if g > rt:
        return False
    smem = 4 * (shared_floats(dialect, d, g) + max(TABLE_SLOTS[dialect], bn))
    return smem <= SHARED_BYTES[dialect]


def plan_partitions(meta: AttentionMetadata, dialect: str) -> tuple[int, int]:
    """(P, tokens per partition) for the decode rows of this step; P = 1 means no merge pass."""
    bs = meta.block_size
    decode = meta.query_lens_np == 1
    longest = int(meta.seq_lens_np[decode].max()) if decode.any() else 0
    ps = -(-PARTITION_TOKENS // bs) * bs
    if longest <= ps:
        return 1, ps
    # Very long contexts stretch the partition until its table slice fits in shared memory.
    ps = max(ps, -(-longest // (TABLE_SLOTS[dialect] * bs)) * bs)
    ps = min(ps, TABLE_SLOTS[dialect] * bs)
    return -(-longest // ps), ps
