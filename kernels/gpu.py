"""Paged attention through the custom GPU kernel, Metal or CUDA (``source.py``).

The host side plans the launch once per step from the host metadata (grid
size, KV partitions, which paths the batch needs) and picks tile shapes that
fit the dialect's shared memory. Decode rows and short chunks (speculative
verification windows, small prefill chunks) run in one launch; long fp16/bf16
prefill chunks without window or softcap go to MLX's fused SDPA over their
gathered context instead, because the kernel's scalar tile path is far slower
than matrix-unit attention (numbers in ``bench/kernels/RESULTS.md``). A
configuration the kernel does not cover returns ``None`` so the caller falls
back to the reference.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from kernels import reference, source
from kernels.metadata import AttentionMetadata

HEAD_DIMS = (64, 80, 96, 128, 256)
# Threadgroup memory a Metal thread group may use; CUDA takes dynamic shared memory up to this.
SHARED_BYTES = {"metal": 32 * 1024, "cuda": 160 * 1024}
# Block-table entries a decode partition stages in shared memory.
TABLE_SLOTS = {"metal": 256, "cuda": 512}
PARTITION_TOKENS = 512  # KV tokens per decode partition before the table limit stretches it
SDPA_CHUNK_TOKENS = 64  # prefill chunks at least this long may take MLX's fused SDPA (see chunks_take_sdpa)
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
    """Tokens each lane group loads per decode step before using them (bytes in flight vs registers)."""
    return 2 if lanes == 16 else 4


def decode_prefetch(lanes: int) -> bool:
    """Whether a decode step issues the next step's loads before its own math."""
    return True


def shared_floats(dialect: str, head_dim: int, group: int) -> int:
    rt, bn = tile_shape(dialect, head_dim)
    tile = head_dim * (rt + 4) + head_dim * (bn + 1) + rt * (bn + 1) + 2 * rt
    row = NW * group * head_dim + 2 * NW * group
    return max(tile, row)


def supported(dialect: str, q: mx.array, k_cache: mx.array) -> bool:
    _, h, d = q.shape
    hkv = k_cache.shape[2]
    if d not in HEAD_DIMS or h % hkv or k_cache.shape[3] != d:
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


@lru_cache(maxsize=None)
def _kernels(dialect: str, shared_bytes: int):
    header, body = source.render_main(dialect)
    rheader, rbody = source.render_reduce(dialect)
    if dialect == "metal":
        main = mx.fast.metal_kernel(
            name="mlxd_paged_attention", input_names=source.MAIN_INPUTS,
            output_names=source.MAIN_OUTPUTS, source=body, header=header,
        )
        reduce = mx.fast.metal_kernel(
            name="mlxd_paged_attention_reduce", input_names=source.REDUCE_INPUTS,
            output_names=source.REDUCE_OUTPUTS, source=rbody, header=rheader,
        )
    else:
        main = mx.fast.cuda_kernel(
            name="mlxd_paged_attention", input_names=source.MAIN_INPUTS,
            output_names=source.MAIN_OUTPUTS, source=body, header=header,
            shared_memory=shared_bytes,
        )
        reduce = mx.fast.cuda_kernel(
            name="mlxd_paged_attention_reduce", input_names=source.REDUCE_INPUTS,
            output_names=source.REDUCE_OUTPUTS, source=rbody, header=rheader,
        )
    return main, reduce


@lru_cache(maxsize=64)
def _fparams(scale: float, softcap: float, window: int) -> mx.array:
    # Layers share these few values; one small device array each, not one per call.
    return mx.array([scale, softcap, float(window)], dtype=mx.float32)


def _decode_subset(meta: AttentionMetadata, decode: np.ndarray) -> AttentionMetadata:
    """The metadata of just the decode requests ``decode``, in that order, one row each."""
    idx = mx.array(decode.astype(np.int32))
    rows = mx.array(meta.cu_seqlens_q_np[decode].astype(np.int32))
    n = len(decode)
    return AttentionMetadata(
        cu_seqlens_q=mx.arange(n + 1, dtype=mx.int32),
        seq_lens=meta.seq_lens[idx],
        block_tables=meta.block_tables[idx],
        slot_mapping=meta.slot_mapping[rows],
        positions=meta.positions[rows],
        query_lens_np=np.ones(n, dtype=np.int32),
        seq_lens_np=meta.seq_lens_np[decode],
        cu_seqlens_q_np=np.arange(n + 1, dtype=np.int32),
        block_size=meta.block_size,
    )


class _StepPlan:
    """Launch plan of one step, shared by all its layers (same metadata object)."""

    __slots__ = ("meta", "dialect", "parts", "part_tokens", "iparams", "has_rows", "has_tiles", "long_chunks",
                 "_decode")

    def __init__(self, meta: AttentionMetadata, dialect: str):
        self.meta = meta
        self.dialect = dialect
        self.parts, self.part_tokens = plan_partitions(meta, dialect)
        width = meta.block_tables.shape[1]
        self.iparams = mx.array(
            np.array([meta.num_seqs, width, self.parts, self.part_tokens], dtype=np.int32)
        )
        self.has_rows = bool((meta.query_lens_np == 1).any())
        self.has_tiles = bool((meta.query_lens_np > 1).any())
        self.long_chunks = bool((meta.query_lens_np >= SDPA_CHUNK_TOKENS).any())
        self._decode = None

    def decode_plan(self) -> "_StepPlan":
        """Plan of the decode rows alone (when the chunks take the SDPA route)."""
        if self._decode is None:
            decode = np.flatnonzero(self.meta.query_lens_np == 1)
            self._decode = _StepPlan(_decode_subset(self.meta, decode), self.dialect)
        return self._decode


_last_plan: list[_StepPlan] = []


def _plan(meta: AttentionMetadata, dialect: str) -> _StepPlan:
    # Every layer of a step passes the same metadata object: plan once per step.
    if _last_plan and _last_plan[0].meta is meta and _last_plan[0].dialect == dialect:
        return _last_plan[0]
    plan = _StepPlan(meta, dialect)
    _last_plan[:] = [plan]
    return plan


def _launch(
    plan: _StepPlan, q: mx.array, k_cache: mx.array, v_cache: mx.array, scale: float,
    sliding_window: int | None, softcap: float | None,
) -> mx.array:
    """One attention launch over the whole packed batch, plus the merge pass when decode rows split."""
    dialect, meta = plan.dialect, plan.meta
    t, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = h // hkv
    rt, bn = tile_shape(dialect, d)
    sf = shared_floats(dialect, d, g)
    si = max(TABLE_SLOTS[dialect], bn)
    main, reduce = _kernels(dialect, 4 * (sf + si) if dialect == "cuda" else 0)
    b = meta.num_seqs
    p = plan.parts
    nqb = t // (rt // g) + b
    lpt = lanes_per_token(d)
    fparams = _fparams(float(scale), float(softcap or 0.0), int(sliding_window or 0))
    split = (b * h * p * d,) if p > 1 else (1,)
    out, part_o, part_ml = main(
        inputs=[q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                plan.iparams, fparams],
        template=[("T", q.dtype), ("D", d), ("G", g), ("HKV", hkv), ("BS", bs), ("RT", rt),
                  ("BN", bn), ("LPT", lpt), ("U", decode_unroll(lpt)),
                  ("PF", decode_prefetch(lpt)), ("SMEM_F", sf), ("SMEM_I", si),
                  ("ROWS", plan.has_rows), ("TILES", plan.has_tiles)],
        grid=(nqb * p * NT, hkv, 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[q.shape, split, (b * h * p * 2,) if p > 1 else (1,)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
    )
    if p == 1:
        return out
    (merged,) = reduce(
        inputs=[out, part_o, part_ml, meta.cu_seqlens_q, meta.seq_lens, plan.iparams],
        template=[("T", q.dtype), ("D", d), ("H", h)],
        grid=(t * NT, 1, 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return merged


def chunks_take_sdpa(plan: _StepPlan, q: mx.array, sliding_window: int | None, softcap: float | None) -> bool:
    """Long prefill chunks go to MLX's fused SDPA (matrix units) over gathered K/V.

    On the H200 the scalar tile path ran ~50x behind cuDNN's flash attention on
    8 x 2K chunks, while gathering a chunk's context costs one pass over it. The
    tile path keeps what SDPA cannot fuse (windows, softcap, fp32) and short chunks.
    """
    return (plan.long_chunks and sliding_window is None and softcap is None
            and q.dtype in (mx.float16, mx.bfloat16))


def paged_attention(
    dialect: str, q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None,
    route_chunks: bool = True,
) -> mx.array | None:
    """The kernel's answer to ``reference.paged_attention``, or None where the kernel does not apply.

    ``route_chunks=False`` keeps long chunks on the tile path (one launch for the whole batch).
    """
    if not supported(dialect, q, k_cache):
        return None
    plan = _plan(meta, dialect)
    if not (route_chunks and chunks_take_sdpa(plan, q, sliding_window, softcap)):
        return _launch(plan, q, k_cache, v_cache, scale, sliding_window, softcap)

    def decode_fn(decode: np.ndarray) -> mx.array:
        rows = mx.array(meta.cu_seqlens_q_np[decode].astype(np.int32))
        return _launch(plan.decode_plan(), q[rows], k_cache, v_cache, scale, sliding_window, softcap)

    return reference.attention_by_kind(q, k_cache, v_cache, meta, scale, sliding_window, softcap,
                                       decode_fn=decode_fn)
