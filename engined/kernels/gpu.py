"""Paged attention through the custom GPU kernel, Metal or CUDA (``source.py``).

The host side plans the launch once per step from the host metadata (grid
size, KV partitions, which paths the batch needs), with the tile shapes and
shared memory that ``gpu_geometry`` fits to the dialect. Decode rows and
short chunks (speculative verification windows, small prefill chunks) run in
one launch; long fp16/bf16 prefill chunks without window or softcap go to
MLX's fused SDPA instead, because the kernel's scalar tile path is far slower
than matrix-unit attention (numbers in ``bench/kernels/RESULTS.md``):
adjacent chunks of one shape share one SDPA call over their paged context,
read in place where the blocks are consecutive (``_StepPlan.in_place``; Metal only) and
otherwise from a head-major copy (``gather_runs``, one launch for all of a
step's runs), reading q and writing the output in packed order without
copies. On CUDA each new SDPA shape costs a cuDNN graph build on the host (~47 ms), so
chunks are padded at the end to a query length that is a multiple of ``SDPA_BUCKET`` and grouped by
padded shape in batches of a power of two: fresh prompts then meet a few shapes per process, not one
per prompt. ``paged_attention`` returns ``None`` for a configuration the kernel
does not cover; ``attention`` then runs the reference.

Over 400 lines because the step's plan (which chunks take SDPA, in which padded buckets, read in place
or gathered) and the launches that follow it are one decision: split, the plan's dozen fields would
become a wire between two modules that always change together.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from mlxd.engined.kernels import gpu_geometry as geo
from mlxd.engined.kernels import paged_kv, source
from mlxd.engined.kernels.paged_kv import AttentionMetadata, in_packed_order

SDPA_CHUNK_TOKENS = 64  # prefill chunks at least this long may take MLX's fused SDPA (see chunks_take_sdpa)
# CUDA pads an SDPA chunk's queries and context at the end to a multiple of this many rows (exact under
# the bottom-right causal mask: no real query reaches a padded key), so that chunk shapes repeat.
SDPA_BUCKET = 256
NO_SKIP = 1 << 30
# Groups per multiprocessor a decode-only CUDA launch asks the compiler to fit (0: its choice).
DECODE_MIN_GROUPS = 0


@lru_cache(maxsize=None)
def _kernels(dialect: str, shared_bytes: int, min_groups: int = 0):
    """(attention, merge, gather) kernels; CUDA fixes the dynamic shared memory per kernel object.
    A launch bound changes the compiled code under the same template, so it is in the name."""
    name = "mlxd_paged_attention" + (f"_lb{min_groups}" if min_groups else "")
    parts = [(name, source.render_main(dialect, min_groups), source.MAIN_INPUTS, source.MAIN_OUTPUTS,
              shared_bytes),
             ("mlxd_paged_attention_reduce", source.render_reduce(dialect), source.REDUCE_INPUTS,
              source.REDUCE_OUTPUTS, 0),
             ("mlxd_paged_gather", source.render_gather(dialect), source.GATHER_INPUTS, source.GATHER_OUTPUTS, 0)]
    made = []
    for name, (header, body), inputs, outputs, smem in parts:
        if dialect == "metal":
            made.append(mx.fast.metal_kernel(name=name, input_names=inputs, output_names=outputs,
                                             source=body, header=header))
        else:
            made.append(mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs,
                                            source=body, header=header, shared_memory=smem))
    return tuple(made)


@lru_cache(maxsize=64)
def _fparams(scale: float, softcap: float, window: int) -> mx.array:
    # Layers share these few values; one small device array each, not one per call.
    return mx.array([scale, softcap, float(window)], dtype=mx.float32)


@lru_cache(maxsize=64)
def _iparams(*values: int) -> mx.array:
    return mx.array(np.array(values, dtype=np.int32))


def _subset(meta: AttentionMetadata, reqs: np.ndarray) -> tuple[AttentionMetadata, np.ndarray]:
    """The metadata of just the requests ``reqs`` (in that order), and their rows in the packed batch."""
    qlens = meta.query_lens_np[reqs]
    cu = np.zeros(len(reqs) + 1, dtype=np.int32)
    np.cumsum(qlens, out=cu[1:])
    starts = meta.cu_seqlens_q_np[reqs]
    rows = (np.repeat(starts - cu[:-1], qlens) + np.arange(cu[-1])).astype(np.int32)
    idx = mx.array(reqs.astype(np.int32))
    rows_mx = mx.array(rows)
    sub = AttentionMetadata(
        cu_seqlens_q=mx.array(cu),
        seq_lens=meta.seq_lens[idx],
        block_tables=meta.block_tables[idx],
        slot_mapping=meta.slot_mapping[rows_mx],
        positions=meta.positions[rows_mx],
        query_lens_np=qlens.astype(np.int32),
        seq_lens_np=meta.seq_lens_np[reqs],
        cu_seqlens_q_np=cu,
        block_size=meta.block_size,
    )
    return sub, rows


@dataclass(frozen=True)
class SdpaRun:
    """Long chunks one SDPA call serves: requests ``reqs``, each padded at the end to ``query_len``
    queries over ``seq_len`` positions (its own lengths where nothing is padded)."""

    reqs: np.ndarray
    query_len: int
    seq_len: int


@dataclass(frozen=True)
class RunRows:
    """Where a run's queries come from and its answers go: ``take`` the packed rows of its padded
    queries (None: a view of consecutive rows from ``start``), ``keep`` its real answers among the
    padded ones (None: all), ``rows`` those answers' rows in the packed batch."""

    start: int
    take: mx.array | None
    keep: mx.array | None
    rows: np.ndarray


@dataclass(frozen=True)
class ContextLayout:
    """One step's plan for ``gather_runs``: a thread group per (request, logical block) in ``work``,
    each request's first output row, rows per head and context length in ``dst``. Rows past a
    context's length (padding) are zeros: masked keys must hold finite values."""

    work: mx.array  # [2 * groups] int32
    dst: mx.array  # [3 * B] int32
    groups: int
    rows: int
    offsets: list[int]
    padded: bool


class _StepPlan:
    """Launch plan of one step, shared by all its layers (same metadata object)."""

    __slots__ = ("meta", "dialect", "parts", "part_tokens", "iparams", "has_rows", "has_tiles", "long_chunks",
                 "_routed", "_layouts", "_in_place", "_run_rows", "launches")

    def __init__(self, meta: AttentionMetadata, dialect: str):
        self.meta = meta
        self.dialect = dialect
        self.parts, self.part_tokens = geo.plan_partitions(meta, dialect)
        width = meta.block_tables.shape[1]
        self.iparams = _iparams(meta.num_seqs, width, self.parts, self.part_tokens, NO_SKIP)
        self.has_rows = bool((meta.query_lens_np == 1).any())
        self.has_tiles = bool((meta.query_lens_np > 1).any())
        self.long_chunks = bool((meta.query_lens_np >= SDPA_CHUNK_TOKENS).any())
        self._routed = None
        self._layouts: dict[tuple[int, int], ContextLayout] = {}
        self._in_place: dict[int, list[tuple[int, int] | None]] = {}
        self._run_rows: list[RunRows] | None = None
        # What ``_launch`` derives from the shapes and the layer's settings, once per step for every
        # layer that shares them (all layers of most models).
        self.launches: dict[tuple, tuple] = {}

    def routed(self):
        """(plan of the kernel's requests or None, their packed rows, SDPA runs) when long chunks
        go to SDPA. On Metal a run is adjacent chunks of one shape; on CUDA, chunks of one padded
        shape (``SDPA_BUCKET``) in batches of a power of two, so that a step's calls meet shapes
        that earlier steps built."""
        if self._routed is None:
            meta = self.meta
            long = meta.query_lens_np >= SDPA_CHUNK_TOKENS
            rest = np.flatnonzero(~long)
            sub, rows = (None, np.zeros(0, dtype=np.int32))
            if len(rest):
                sub_meta, rows = _subset(meta, rest)
                sub = _StepPlan(sub_meta, self.dialect)
            chunks = np.flatnonzero(long)
            runs = _bucketed_runs(meta, chunks) if self.dialect == "cuda" else _adjacent_runs(meta, chunks)
            self._routed = (sub, rows, runs)
        return self._routed

    def run_rows(self) -> list[RunRows]:
        """Per SDPA run, its queries' and answers' rows (shared by every layer of the step)."""
        if self._run_rows is None:
            cu, qlens = self.meta.cu_seqlens_q_np, self.meta.query_lens_np
            self._run_rows = []
            for run in self.routed()[2]:
                lens, starts = qlens[run.reqs], cu[run.reqs]
                rows = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lens)])
                if (lens == run.query_len).all() and (np.diff(run.reqs) == 1).all():
                    self._run_rows.append(RunRows(int(starts[0]), None, None, rows))
                    continue
                pad = np.arange(run.query_len)
                take = (starts[:, None] + np.minimum(pad, lens[:, None] - 1)).reshape(-1)  # padding repeats a row
                keep = np.flatnonzero((pad < lens[:, None]).reshape(-1))
                self._run_rows.append(RunRows(int(starts[0]), mx.array(take.astype(np.int32)),
                                              mx.array(keep.astype(np.int32)), rows))
        return self._run_rows

    def in_place(self, num_blocks: int) -> list[tuple[int, int] | None]:
        """Per SDPA run, ``(first block, blocks from chunk to chunk)`` where SDPA can read the cache
        itself: each chunk's blocks consecutive and in order, the chunks evenly spaced (as a fresh
        pool hands out blocks). SDPA reads that token-major view as fast as a gathered copy
        (``bench/kernels/RESULTS.md``), so such runs skip the gather; None elsewhere.

        None for every run on CUDA: MLX's CUDA SDPA builds a cuDNN graph, ~45 ms of host time on
        the H200, for every new combination of its inputs' shapes and strides, and a view's strides
        follow where the pool put the blocks. Gathered, a chunk shape's graph is built once; read in
        place, once more for each layout (``bench/kernels/sdpa_shapes.py``)."""
        if self.dialect == "cuda":
            return [None] * len(self.routed()[2])
        if num_blocks not in self._in_place:
            _, _, runs = self.routed()
            tables = np.asarray(self.meta.block_tables)
            bs = self.meta.block_size
            places = []
            for run in runs:
                b0, n, sl = int(run.reqs[0]), len(run.reqs), run.seq_len
                t = tables[b0 : b0 + n, : -(-sl // bs)]
                span = int(t[1, 0] - t[0, 0]) if n > 1 else t.shape[1]
                ok = ((t - t[:, :1] == np.arange(t.shape[1])).all() and span >= t.shape[1]
                      and (t[:, 0] == t[0, 0] + span * np.arange(n)).all() and t[0, 0] + n * span <= num_blocks)
                places.append((int(t[0, 0]), span) if ok else None)
            self._in_place[num_blocks] = places
        return self._in_place[num_blocks]

    def context_layout(self, hkv: int, num_blocks: int) -> ContextLayout:
        """Where ``gather_runs`` puts the SDPA runs' contexts for caches with ``hkv`` KV heads:
        run ``r`` (``n`` chunks, ``sl`` positions each with padding) is rows ``offsets[r]`` on,
        ``[n, hkv, sl, D]``."""
        if (hkv, num_blocks) not in self._layouts:
            _, _, runs = self.routed()
            bs = self.meta.block_size
            dst = np.zeros((self.meta.num_seqs, 3), dtype=np.int32)
            work, offsets, at, padded = [], [], 0, False
            for run, place in zip(runs, self.in_place(num_blocks)):
                offsets.append(at)
                if place is not None:
                    continue
                n, sl = len(run.reqs), run.seq_len
                lens = self.meta.seq_lens_np[run.reqs]
                padded |= bool((lens < sl).any())
                dst[run.reqs, 0] = at + np.arange(n) * hkv * sl
                dst[run.reqs, 1] = sl
                dst[run.reqs, 2] = lens
                blocks = -(-lens // bs)
                work.append(np.stack([np.repeat(run.reqs, blocks), np.concatenate([np.arange(k) for k in blocks])],
                                     axis=1))
                at += n * hkv * sl
            work_np = np.concatenate(work or [np.zeros((0, 2))]).astype(np.int32)
            self._layouts[hkv, num_blocks] = ContextLayout(
                mx.array(work_np.reshape(-1)), mx.array(dst.reshape(-1)), len(work_np), at, offsets, padded)
        return self._layouts[hkv, num_blocks]


def _adjacent_runs(meta: AttentionMetadata, chunks: np.ndarray) -> list[SdpaRun]:
    """Adjacent chunks of one (query length, context length) in one run each."""
    qlens, slens = meta.query_lens_np, meta.seq_lens_np
    runs: list[list[int]] = []
    for b in map(int, chunks):
        if runs and runs[-1][-1] + 1 == b and (qlens[b], slens[b]) == (qlens[b - 1], slens[b - 1]):
            runs[-1].append(b)
        else:
            runs.append([b])
    return [SdpaRun(np.array(r), int(qlens[r[0]]), int(slens[r[0]])) for r in runs]


def _bucketed_runs(meta: AttentionMetadata, chunks: np.ndarray) -> list[SdpaRun]:
    """Chunks grouped by their shape padded to ``SDPA_BUCKET`` queries (the context by as many rows),
    each group split in batches of a power of two: a shape is its (batch, queries, context)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for b in map(int, chunks):
        ql, sl = int(meta.query_lens_np[b]), int(meta.seq_lens_np[b])
        qp = -(-ql // SDPA_BUCKET) * SDPA_BUCKET
        groups.setdefault((qp, sl + qp - ql), []).append(b)
    runs = []
    for (qp, sp), reqs in groups.items():
        while reqs:
            n = 1 << (len(reqs).bit_length() - 1)
            runs.append(SdpaRun(np.array(reqs[:n]), qp, sp))
            reqs = reqs[n:]
    return runs


def _plan(meta: AttentionMetadata, dialect: str) -> _StepPlan:
    # Every layer of a step passes the same metadata: plan once per step, kept on the metadata.
    plan = meta.plans.get(dialect)
    if plan is None:
        plan = meta.plans[dialect] = _StepPlan(meta, dialect)
    return plan


def _launch(
    plan: _StepPlan, q: mx.array, k_cache: mx.array, v_cache: mx.array, scale: float,
    sliding_window: int | None, softcap: float | None,
) -> mx.array:
    """One attention launch over the whole packed batch, plus the merge pass when decode rows split."""
    key = (q.shape, q.dtype, k_cache.shape, scale, sliding_window, softcap)
    spec = plan.launches.get(key)
    if spec is None:
        spec = plan.launches[key] = _launch_spec(plan, q, k_cache, scale, sliding_window, softcap)
    main, fparams, launch, merge = spec
    meta = plan.meta
    out, part_o, part_ml = main(
        inputs=[q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, plan.iparams, fparams],
        **launch)
    if merge is None:
        return out
    reduce, merge_launch = merge
    (merged,) = reduce(inputs=[out, part_o, part_ml, meta.cu_seqlens_q, meta.seq_lens, plan.iparams],
                       **merge_launch)
    return merged


def _launch_spec(plan: _StepPlan, q: mx.array, k_cache: mx.array, scale: float, sliding_window: int | None,
                 softcap: float | None) -> tuple:
    """``_launch``'s (kernel, float parameters, launch arguments, merge kernel and its arguments or
    None) for these shapes and settings."""
    dialect, meta = plan.dialect, plan.meta
    t, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = h // hkv
    gh = geo.row_heads(dialect, d, g)
    rt, bn = geo.tile_shape(dialect, d)
    # Shared memory sized for the paths this batch uses: a decode-only launch keeps it small,
    # so more groups fit on a multiprocessor.
    sf = geo.shared_floats(dialect, d, g, plan.has_rows, plan.has_tiles)
    si = max(geo.TABLE_SLOTS[dialect], bn)
    min_groups = DECODE_MIN_GROUPS if dialect == "cuda" and not plan.has_tiles else 0
    main, reduce, _ = _kernels(dialect, 4 * (sf + si) if dialect == "cuda" else 0, min_groups)
    b = meta.num_seqs
    p = plan.parts
    nqb = t // (rt // g) + b
    lpt = geo.lanes_per_token(d)
    fparams = _fparams(float(scale), float(softcap or 0.0), int(sliding_window or 0))
    split = (b * h * p * d,) if p > 1 else (1,)
    launch = dict(
        template=[("T", q.dtype), ("D", d), ("G", g), ("HKV", hkv), ("BS", bs), ("RT", rt),
                  ("BN", bn), ("LPT", lpt), ("U", geo.decode_unroll(lpt)), ("GH", gh), ("NS", g // gh),
                  ("SC", geo.SUBCHUNK[dialect]), ("AS", geo.DECODE_ACC_SHARED), ("SMEM_F", sf), ("SMEM_I", si),
                  ("ROWS", plan.has_rows), ("TILES", plan.has_tiles)],
        grid=(nqb * p * hkv * (g // gh) * geo.NT, 1, 1),
        threadgroup=(geo.NT, 1, 1),
        output_shapes=[q.shape, split, (b * h * p * 2,) if p > 1 else (1,)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
    )
    merge = None
    if p > 1:
        merge = (reduce, dict(template=[("T", q.dtype), ("D", d), ("H", h)], grid=(t * geo.NT, h, 1),
                              threadgroup=(geo.NT, 1, 1), output_shapes=[q.shape], output_dtypes=[q.dtype]))
    return main, fparams, launch, merge


def gather_runs(
    dialect: str, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, layout: ContextLayout,
) -> tuple[mx.array, mx.array]:
    """K and V ``[layout.rows, D]``: every SDPA run's paged context, head-major, in one launch."""
    _, bs, hkv, d = k_cache.shape
    _, _, gather = _kernels(dialect, 0)
    k, v = gather(
        inputs=[k_cache, v_cache, meta.block_tables, layout.work, layout.dst,
                _iparams(meta.block_tables.shape[1])],
        template=[("T", k_cache.dtype), ("D", d), ("HKV", hkv), ("BS", bs), ("W", 16 // k_cache.dtype.size)],
        grid=(layout.groups * geo.NT, 1, 1),
        threadgroup=(geo.NT, 1, 1),
        output_shapes=[(layout.rows, d)] * 2,
        output_dtypes=[k_cache.dtype] * 2,
        init_value=0.0 if layout.padded else None,
    )
    return k, v


def _cache_view(cache: mx.array, place: tuple[int, int], n: int, length: int) -> mx.array:
    """``[n, H_kv, length, D]`` read in place from the cache: n chunks of consecutive blocks, the
    first at block ``place[0]``, each ``place[1]`` blocks after the one before. Slices and
    reshapes only, which MLX keeps as views of the cache."""
    _, bs, hkv, d = cache.shape
    first, span = place
    rows = cache[first : first + n * span].reshape(n, span * bs, hkv, d)
    return rows[:, :length].transpose(0, 2, 1, 3)


def run_contexts(
    plan: _StepPlan, k_cache: mx.array, v_cache: mx.array, gathered: tuple[mx.array, mx.array] | None,
) -> list[tuple[mx.array, mx.array]]:
    """K and V ``[n, H_kv, context, D]`` of each SDPA run: the cache read in place where the
    run's blocks allow it, else its rows of the ``gather_runs`` output."""
    _, _, runs = plan.routed()
    hkv = k_cache.shape[2]
    layout = plan.context_layout(hkv, k_cache.shape[0])
    out = []
    for run, offset, place in zip(runs, layout.offsets, plan.in_place(k_cache.shape[0])):
        n, sl = len(run.reqs), run.seq_len
        if place is None:
            out.append(tuple(c[offset : offset + n * hkv * sl].reshape(n, hkv, sl, -1) for c in gathered))
        else:
            out.append(tuple(_cache_view(c, place, n, sl) for c in (k_cache, v_cache)))
    return out


def _sdpa_run(q: mx.array, k: mx.array, v: mx.array, where: RunRows, query_len: int, scale: float) -> mx.array:
    """The answers of the ``count`` chunks of ``k``/``v`` ``[count, H_kv, context, D]``, in the packed
    order of their real rows, their queries ``query_len`` rows each as ``where`` takes them from ``q``."""
    n = k.shape[0]
    _, h, d = q.shape
    # Unpadded consecutive rows are views: SDPA reads them strided and writes its output in q's layout,
    # so the result is already [rows, H, D] without a copy.
    rows = q[where.start : where.start + n * query_len] if where.take is None else q[where.take]
    qv = rows.reshape(n, query_len, h, d).transpose(0, 2, 1, 3)
    # MLX's causal mask is aligned to the last key: exactly a chunk after its cached context.
    out = mx.fast.scaled_dot_product_attention(qv, k, v, scale=scale, mask="causal")
    out = out.transpose(0, 2, 1, 3).reshape(n * query_len, h, d)
    return out if where.keep is None else out[where.keep]


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
    """The kernel's answer to ``paged_kv.reference_attention``, or None where the kernel does not apply.

    ``route_chunks=False`` keeps long chunks on the tile path (one launch for the whole batch).
    """
    if not geo.supported(dialect, q, k_cache):
        return None
    plan = _plan(meta, dialect)
    if not (route_chunks and chunks_take_sdpa(plan, q, sliding_window, softcap)):
        return _launch(plan, q, k_cache, v_cache, scale, sliding_window, softcap)

    sub, rows, runs = plan.routed()
    pieces, order = [], []
    if sub is not None:
        # The kernel's rows: a prefix of the batch is a view, anything else a gather of q.
        prefix = rows[-1] == len(rows) - 1
        q_sub = q[: len(rows)] if prefix else q[mx.array(rows)]
        pieces.append(_launch(sub, q_sub, k_cache, v_cache, scale, sliding_window, softcap))
        order.append(rows)
    hkv = k_cache.shape[2]
    layout = plan.context_layout(hkv, k_cache.shape[0])
    gathered = gather_runs(dialect, k_cache, v_cache, meta, layout) if layout.groups else None
    for run, where, (k, v) in zip(runs, plan.run_rows(), run_contexts(plan, k_cache, v_cache, gathered)):
        pieces.append(_sdpa_run(q, k, v, where, run.query_len, scale))
        order.append(where.rows)
    return in_packed_order(pieces, order, meta.num_tokens)


def attention(
    dialect: str, q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """``paged_kv.reference_attention``'s contract on a GPU: the kernel where it applies (no sinks yet), else
    the reference."""
    out = None if sinks is not None else paged_attention(dialect, q, k_cache, v_cache, meta, scale,
                                                         sliding_window, softcap)
    if out is None:
        out = paged_kv.reference_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
    return out
