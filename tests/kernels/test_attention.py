"""Paged attention: the reference against dense SDPA on padded batches, the GPU launch plan, and the kernel source."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engined import kernels
from mlxd.engined.kernels import gpu, paged_kv, source
from mlxd.engined.kernels import gpu_geometry as geo
from tests.kernels.cases import dense_attention, host_gather_runs, make_case, rel_error
from mlxd.engined.kernels.paged_kv import AttentionMetadata

TOL = {mx.float32: 2e-5, mx.float16: 3e-3, mx.bfloat16: 2e-2}


@pytest.fixture
def rng():
    # Fresh inputs every run: the implementations must agree on any valid batch.
    seed = np.random.SeedSequence().entropy
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def _mixed_lengths(rng, num_decode, prefill_chunks, max_ctx):
    """Decode rows with random contexts plus prefill chunks that sit after some cached context."""
    qlens, slens = [], []
    for _ in range(num_decode):
        qlens.append(1)
        slens.append(int(rng.integers(1, max_ctx + 1)))
    for chunk in prefill_chunks:
        qlens.append(chunk)
        slens.append(chunk + int(rng.integers(0, max_ctx - chunk + 1)))
    order = rng.permutation(len(qlens))  # decode and prefill rows interleaved in the packed batch
    return [qlens[i] for i in order], [slens[i] for i in order]


def _check(case, sliding_window=None, softcap=None, dtype=mx.float32):
    out = paged_kv.reference_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                    sliding_window=sliding_window, softcap=softcap)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    ref = dense_attention(case, sliding_window=sliding_window, softcap=softcap)
    err = rel_error(out, ref)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2)])  # GQA 1, 4, 8
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_attention_reference_mixed_batch_matches_dense_sdpa(rng, num_heads, num_kv_heads, block_size):
    qlens, slens = _mixed_lengths(rng, num_decode=5, prefill_chunks=[1 + int(rng.integers(2, 40)), 17], max_ctx=300)
    case = make_case(rng, qlens, slens, num_heads, num_kv_heads, 64, block_size)
    _check(case)


def test_attention_reference_long_contexts_up_to_8k(rng):
    qlens = [1, 1, 64, 1]
    slens = [8192, int(rng.integers(4000, 8192)), 8192, 3]
    case = make_case(rng, qlens, slens, 8, 2, 64, 16)
    _check(case)


@pytest.mark.parametrize("window", [1, 7, 100])
def test_attention_reference_sliding_window(rng, window):
    qlens, slens = _mixed_lengths(rng, num_decode=4, prefill_chunks=[33, 5], max_ctx=400)
    case = make_case(rng, qlens, slens, 8, 2, 64, 16)
    _check(case, sliding_window=window)


def test_attention_reference_softcap(rng):
    qlens, slens = _mixed_lengths(rng, num_decode=3, prefill_chunks=[20], max_ctx=200)
    case = make_case(rng, qlens, slens, 8, 4, 64, 8)
    case.q = case.q * 4  # large logits, so the cap changes the answer
    _check(case, softcap=5.0)
    _check(case, sliding_window=16, softcap=5.0)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("head_dim", [80, 128])
def test_attention_reference_half_precision(rng, dtype, head_dim):
    qlens, slens = _mixed_lengths(rng, num_decode=3, prefill_chunks=[24], max_ctx=150)
    case = make_case(rng, qlens, slens, 8, 2, head_dim, 16, dtype=dtype)
    _check(case, dtype=dtype)


def test_attention_write_kv_then_read_back_matches_dense(rng):
    """New rows scattered by slot_mapping are exactly what the next attention call reads."""
    qlens, slens = [1, 6, 1], [40, 6, 17]
    case = make_case(rng, qlens, slens, 4, 2, 64, 8)
    t = case.meta.num_tokens
    k_new = mx.array(rng.standard_normal((t, 2, 64)).astype(np.float32))
    v_new = mx.array(rng.standard_normal((t, 2, 64)).astype(np.float32))
    kc, vc = kernels.write_kv(case.k_cache, case.v_cache, k_new, v_new, case.meta)
    cu = case.meta.cu_seqlens_q_np
    for i, (ql, sl) in enumerate(zip(qlens, slens)):
        case.k_dense[i][sl - ql:] = np.asarray(k_new[cu[i] : cu[i] + ql])
        case.v_dense[i][sl - ql:] = np.asarray(v_new[cu[i] : cu[i] + ql])
    case.k_cache, case.v_cache = kc, vc
    _check(case)


def test_attention_dispatch_uses_host_path_on_cpu_and_reference_for_half_precision(rng):
    assert mx.default_device().type == mx.DeviceType.cpu
    assert kernels.resolve_backend() == "host"
    case = make_case(rng, [1, 3], [9, 5], 4, 2, 64, 8)
    a = kernels.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    b = paged_kv.host_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert mx.array_equal(a, b)
    half = make_case(rng, [1, 3], [9, 5], 4, 2, 64, 8, dtype=mx.float16)
    a = kernels.paged_attention(half.q, half.k_cache, half.v_cache, half.meta, half.scale)
    b = paged_kv.reference_attention(half.q, half.k_cache, half.v_cache, half.meta, half.scale)
    assert mx.array_equal(a, b)


# ---- the GPU launch plan, checked on the host -------------------------------------------------


def _qblocks(meta: AttentionMetadata, rows_per_tile: int, group: int):
    """Which packed rows each thread group of the kernel's grid takes (the kernel's own arithmetic)."""
    bq = rows_per_tile // group
    cu, b = meta.cu_seqlens_q_np, meta.num_seqs
    nqb = meta.num_tokens // bq + b  # the host's grid size, in thread groups per KV partition
    for gx in range(nqb):
        qb = (cu[b] // bq + b - 1) - gx  # the kernel walks q-blocks backwards
        lo, n = 0, b
        while n > 1:  # the kernel's binary search over cu_seqlens_q
            half = n >> 1
            if cu[lo + half] // bq + lo + half <= qb:
                lo += half
            n -= half
        start = (qb - (cu[lo] // bq + lo)) * bq
        qlen = cu[lo + 1] - cu[lo]
        if start < qlen:
            yield range(cu[lo] + start, cu[lo] + min(start + bq, qlen))


@pytest.mark.parametrize("group", [1, 3, 4, 7, 8])
def test_kernel_grid_covers_every_query_row_once(rng, group):
    for _ in range(20):
        qlens = [int(x) for x in rng.choice([1, 1, 1, 2, 5, 31, 33, 100], size=int(rng.integers(1, 12)))]
        slens = [q + int(rng.integers(0, 50)) for q in qlens]
        meta = AttentionMetadata.build(qlens, slens, [[0] * (-(-s // 16)) for s in slens], 16)
        for dialect in source.DIALECTS:
            rt, _ = geo.tile_shape(dialect, 128)
            if group > rt:
                continue
            seen = np.zeros(meta.num_tokens, int)
            for rows in _qblocks(meta, rt, group):
                seen[list(rows)] += 1
            assert (seen == 1).all()


def test_kernel_subset_keeps_each_rows_context(rng):
    """The decode rows and short chunks of a mixed batch, planned alone when long chunks take SDPA."""
    qlens, slens = _mixed_lengths(rng, num_decode=6, prefill_chunks=[70, 9], max_ctx=200)
    case = make_case(rng, qlens, slens, 4, 2, 64, 8)
    meta = case.meta
    reqs = np.flatnonzero(meta.query_lens_np < gpu.SDPA_CHUNK_TOKENS)
    sub, rows = gpu._subset(meta, reqs)
    assert sub.num_seqs == len(reqs) and sub.num_tokens == len(rows) == meta.query_lens_np[reqs].sum()
    assert (np.asarray(sub.seq_lens) == meta.seq_lens_np[reqs]).all()
    assert (np.asarray(sub.block_tables) == np.asarray(meta.block_tables)[reqs]).all()
    assert (np.asarray(sub.positions) == np.asarray(meta.positions)[rows]).all()
    alone = paged_kv.reference_attention(case.q[mx.array(rows)], case.k_cache, case.v_cache, sub, case.scale)
    full = paged_kv.reference_attention(case.q, case.k_cache, case.v_cache, meta, case.scale)
    assert rel_error(alone, full[mx.array(rows)]) < 1e-6


def _host_kernels(monkeypatch):
    """Stand-ins for the two GPU launches of the chunk route, so its planning and assembly run here."""
    def launch(plan, q, k_cache, v_cache, scale, window, softcap):
        return paged_kv.reference_attention(q, k_cache, v_cache, plan.meta, scale, window, softcap)

    monkeypatch.setattr(gpu, "_launch", launch)
    monkeypatch.setattr(gpu, "gather_runs", host_gather_runs)


@pytest.mark.parametrize("order", ["decode first", "interleaved", "prefill only", "ragged", "in order"])
def test_kernel_chunk_route_batches_equal_chunks_and_keeps_packed_order(rng, monkeypatch, order):
    _host_kernels(monkeypatch)
    if order == "decode first":
        qlens, slens = [1, 1, 5, 64, 64, 64, 80], [300, 17, 40, 64, 64, 64, 200]
    elif order == "interleaved":
        qlens, slens = [64, 1, 64, 64, 3, 1, 70, 70], [100, 50, 100, 100, 9, 700, 70, 70]
    elif order == "prefill only":
        qlens, slens = [96] * 4, [96] * 4
    elif order == "ragged":  # fresh and continued chunks of different lengths: one run each, one gather
        qlens, slens = [64, 100, 1, 81, 81, 77], [64, 333, 50, 81, 81, 200]
    else:  # blocks as a fresh pool hands them out: SDPA reads the cache in place, no gather
        qlens, slens = [1, 96, 96, 80, 70], [50, 96, 96, 300, 77]
    case = make_case(rng, qlens, slens, 8, 2, 64, 16, dtype=mx.float16, shuffle=order != "in order")
    meta = case.meta
    plan = gpu._StepPlan(meta, "cuda")
    sub, rows, runs = plan.routed()
    pool = case.k_cache.shape[0]
    if order == "in order":  # Metal reads in place: (first block, blocks from chunk to chunk)
        metal = gpu._StepPlan(meta, "metal")
        assert metal.in_place(pool) == [(4, 6), (16, 19), (35, 5)] and metal.context_layout(2, pool).groups == 0
        assert metal.in_place(39) == [(4, 6), (16, 19), None]  # a pool too short for the last view
    # CUDA gathers every run (cuDNN's graphs), as every dialect does scattered blocks (4+ per chunk)
    assert plan.in_place(pool) == [None] * len(runs) and plan.context_layout(2, pool).groups > 0
    long = np.flatnonzero(meta.query_lens_np >= gpu.SDPA_CHUNK_TOKENS)
    assert sorted(np.concatenate([r.reqs for r in runs])) == list(long)
    assert (sub is None) == (len(rows) == 0) and len(rows) + meta.query_lens_np[long].sum() == meta.num_tokens
    for run in runs:  # CUDA: one padded shape, a power of two of chunks
        ql, sl = meta.query_lens_np[run.reqs], meta.seq_lens_np[run.reqs]
        assert run.query_len % gpu.SDPA_BUCKET == 0 and (ql <= run.query_len).all()
        assert (sl - ql == run.seq_len - run.query_len).all() and len(run.reqs) & (len(run.reqs) - 1) == 0
    for run in gpu._StepPlan(meta, "metal").routed()[2]:  # Metal: adjacent chunks of one shape
        assert (np.diff(run.reqs) == 1).all()
        assert (meta.query_lens_np[run.reqs] == run.query_len).all() and (meta.seq_lens_np[run.reqs] == run.seq_len).all()
    want = paged_kv.reference_attention(case.q, case.k_cache, case.v_cache, meta, case.scale)
    for dialect in ("cuda", "metal"):
        got = gpu.paged_attention(dialect, case.q, case.k_cache, case.v_cache, meta, case.scale)
        assert rel_error(got, want) < 2e-3


def test_kernel_chunk_route_pads_fresh_prompts_to_few_shapes_on_cuda(rng, monkeypatch):
    """Fresh prompts of 13 lengths meet 2 SDPA shapes on CUDA (a cuDNN graph build each), not 13;
    the padding changes no answer."""
    _host_kernels(monkeypatch)
    qlens = rng.integers(gpu.SDPA_CHUNK_TOKENS, 2 * gpu.SDPA_BUCKET + 1, 13).tolist()
    qlens = [min(q, gpu.SDPA_BUCKET) if i < 6 else max(q, gpu.SDPA_BUCKET + 1) for i, q in enumerate(qlens)]
    qlens, slens = [1, *qlens, 1], [90, *qlens, 300]  # decode rows around them
    case = make_case(rng, qlens, slens, 8, 2, 64, 16, dtype=mx.float16)
    plan = gpu._StepPlan(case.meta, "cuda")
    runs = plan.routed()[2]
    assert {(r.query_len, r.seq_len) for r in runs} == {(256, 256), (512, 512)}
    assert sorted(len(r.reqs) for r in runs if r.query_len == 256) == [2, 4]  # 6 chunks: batches of 4 and 2
    assert sorted(len(r.reqs) for r in runs if r.query_len == 512) == [1, 2, 4]  # 7 chunks: 4, 2 and 1
    assert plan.context_layout(2, case.k_cache.shape[0]).padded
    want = paged_kv.reference_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    got = gpu.paged_attention("cuda", case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert rel_error(got, want) < 2e-3


@pytest.mark.parametrize("dialect", source.DIALECTS)
def test_kernel_decode_heads_divide_the_group_and_fit(dialect):
    for d in geo.HEAD_DIMS:
        for g in (1, 2, 4, 7, 8, 16, 32):
            gh = geo.row_heads(dialect, d, g)
            assert g % gh == 0 and gh >= 1
            el = d // geo.lanes_per_token(d)
            assert gh * el <= geo.ROW_REGISTERS or gh == 1
            assert 4 * (geo.row_floats(dialect, d, gh) + geo.TABLE_SLOTS[dialect]) <= geo.SHARED_BYTES[dialect]


def test_kernel_partitions_cover_the_longest_decode_context():
    for longest in [1, 511, 512, 513, 4096, 100_000, 1_000_000]:
        meta = AttentionMetadata.build([1, 7], [longest, 7], [[0] * (-(-longest // 16)), [0]], 16)
        for dialect in source.DIALECTS:
            p, ps = geo.plan_partitions(meta, dialect)
            assert p * ps >= longest and (p - 1) * ps < longest
            assert ps % 16 == 0 and ps // 16 <= geo.TABLE_SLOTS[dialect]


def test_kernel_shapes_fit_shared_memory():
    for dialect in source.DIALECTS:
        for d in geo.HEAD_DIMS:
            q = mx.zeros((1, 8, d))
            cache = mx.zeros((1, 16, 4, d))
            assert geo.supported(dialect, q, cache)  # GQA 2 at every head dim
            rt, bn = geo.tile_shape(dialect, d)
            # Whole work per thread: score rows (S phase), output rows and columns (P @ V).
            assert rt * bn % source.NUM_THREADS == 0 and rt * 16 % source.NUM_THREADS == 0
            assert d % 16 == 0 and d % geo.lanes_per_token(d) == 0


# ---- the kernel source -----------------------------------------------------------------------


def test_kernel_source_renders_one_body_in_both_dialects():
    metal_h, metal_src = source.render_main("metal")
    cuda_h, cuda_src = source.render_main("cuda")
    assert source.MAIN_BODY in metal_src and source.MAIN_BODY in cuda_src
    assert metal_src.endswith(source.MAIN_BODY) and cuda_src.endswith(source.MAIN_BODY)
    for h in (metal_h, cuda_h):
        assert source.COMMON in h
    # Each dialect's primitives, and none of the other's.
    for word in ["simd_shuffle_xor", "threadgroup_barrier", "threadgroup float smem", "thread_index_in_simdgroup"]:
        assert word in metal_h + metal_src and word not in cuda_h + cuda_src
    for word in ["__shfl_xor_sync", "__syncthreads", "extern __shared__", "threadIdx.x"]:
        assert word in cuda_h + cuda_src and word not in metal_h + metal_src
    # The body itself names no dialect primitive.
    for word in ["simd_", "threadgroup_", "__shfl", "__sync", "threadIdx", "blockIdx", "__shared__", "uint4"]:
        for body in (source.MAIN_BODY, source.REDUCE_BODY, source.GATHER_BODY):
            assert word not in body
    rh, rsrc = source.render_reduce("metal")
    assert rsrc.endswith(source.REDUCE_BODY) and "threadgroup float" not in rsrc


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_kernel_cuda_source_compiles_with_nvcc():
    script = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "nvcc_check.py"
    r = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
