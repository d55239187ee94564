"""The CUDA kernel on an NVIDIA GPU: correctness against the dense oracle, then timings.

Run on the GPU machine with MLX's CUDA backend (see ../shared/tools/mlx-cuda-wheels.sh):

    MLX_ENABLE_TF32=0 python3 bench/kernels/cuda_check.py --out DIR

Writes DIR/RESULTS.md (markdown tables) and DIR/results.json, and prints the tables.
Timings: the lazy graphs of many calls are built first, then evaluated with one
synchronisation (so the times are the GPU's, plus MLX's launch work; Python's
graph building per call is reported apart), median of several repetitions;
inputs are random (never zeros) and larger than L2.

Over 400 lines because each kernel path's correctness check and its timing use the same inputs and
the same oracle; split, the inputs' construction would be copied.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # a float32 oracle must not run its matmuls in tf32
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # after an install or the suite's namespace

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxd.engined.kernels import gpu, paged_kv  # noqa: E402
from mlxd.engined.kernels import gpu_geometry as geo  # noqa: E402
from tests.kernels.cases import dense_attention, host_gather_runs, make_case, rel_error  # noqa: E402
from mlxd.engined.kernels.paged_kv import AttentionMetadata, write_kv  # noqa: E402

TOL = {mx.float32: 1e-4, mx.float16: 3e-3, mx.bfloat16: 1.2e-2}
S = 1  # size divisor (only the CPU dry run shrinks the problems)
DT_NAME = {mx.float32: "fp32", mx.float16: "fp16", mx.bfloat16: "bf16"}


def kernel(q, kc, vc, meta, scale, window=None, softcap=None):
    out = gpu.paged_attention("cuda", q, kc, vc, meta, scale, window, softcap)
    assert out is not None, "configuration not covered by the kernel"
    return out


def timed(fn, iters):
    """(host seconds to build one call's lazy graph, seconds per call to evaluate them). All the
    graphs are built before the clock for the second starts, so it is the device's time plus
    MLX's launch work, not Python's: kernels are compared on what the GPU does."""
    mx.synchronize()
    t0 = time.perf_counter()
    outs = [fn() for _ in range(iters)]
    t1 = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    return (t1 - t0) / iters, (time.perf_counter() - t1) / iters


def bench(fn, iters=20, reps=7):
    """Seconds per call (evaluation only, see ``timed``), median over `reps`, and the spread."""
    if S > 1:  # the CPU dry run only checks that every section runs
        iters, reps = 1, 1
    mx.eval(fn())
    times = [timed(fn, iters)[1] for _ in range(reps)]
    return statistics.median(times), (max(times) - min(times)) / statistics.median(times)


# ---------------------------------------------------------------- correctness


def correctness(rng, rows, log):
    cases = []
    gqa = [(8, 8), (16, 4), (32, 4), (28, 4), (16, 2)]  # G = 1, 4, 8, 7, 8
    i = 0
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for d in (64, 80, 96, 128, 256):
            h, hkv = gqa[i % len(gqa)]
            bs = (8, 16, 32)[i % 3]
            i += 1
            nd = int(rng.integers(1, 9))
            qlens = [1] * nd + [int(rng.integers(2, 80)), 33]
            slens = [int(rng.integers(1, 3000)) for _ in range(nd)] + [0, 0]
            slens[-2] = qlens[-2] + int(rng.integers(0, 1500))
            slens[-1] = 33
            cases.append((f"mixed {DT_NAME[dtype]} D={d} H={h}/{hkv} bs={bs}", qlens, slens, h, hkv, d, bs, dtype, None, None))
    cases += [
        ("decode 8K split + prefill at 8K, bf16", [1, 1, 64, 1], [8192, 5000, 8192, 3], 32, 8, 128, 16, mx.bfloat16, None, None),
        ("decode only, 64 x 1..4K, fp16", [1] * 64, list(rng.integers(1, 4097, 64)), 32, 8, 128, 16, mx.float16, None, None),
        ("prefill only, 3 chunks, fp32", [200, 57, 1], [200, 1000, 1], 8, 2, 128, 16, mx.float32, None, None),
        ("window 1, fp32", [1, 1, 40], [3000, 20, 100], 8, 2, 64, 16, mx.float32, 1, None),
        ("window 7, fp32", [1, 9, 1], [2000, 300, 5], 8, 2, 64, 8, mx.float32, 7, None),
        ("window 1000 over split decode, bf16", [1, 1, 100], [6000, 900, 3000], 32, 8, 128, 16, mx.bfloat16, 1000, None),
        ("softcap 30, fp32", [1, 1, 50], [1500, 10, 400], 16, 8, 256, 16, mx.float32, None, 30.0),
        ("softcap 5 + window 64, fp32", [1, 70], [2500, 700], 8, 4, 128, 32, mx.float32, 64, 5.0),
        ("GQA 32 (H=32, H_kv=1), bf16", [1, 1, 20], [700, 3000, 20], 32, 1, 128, 16, mx.bfloat16, None, None),
    ]
    worst = 0.0
    for name, qlens, slens, h, hkv, d, bs, dtype, window, softcap in cases:
        t0 = time.perf_counter()
        case = make_case(rng, [int(x) for x in qlens], [int(x) for x in slens], h, hkv, d, bs, dtype=dtype)
        if softcap is not None:
            case.q = case.q * 8
        out = kernel(case.q, case.k_cache, case.v_cache, case.meta, case.scale, window, softcap)
        ref = dense_attention(case, sliding_window=window, softcap=softcap)
        # The same batch with every chunk on the kernel's tile path (one launch).
        tiled = gpu.paged_attention("cuda", case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                    window, softcap, route_chunks=False)
        errs = [rel_error(out, ref), rel_error(tiled, ref)]
        mine = float("nan") if any(e != e for e in errs) else max(errs)
        theirs = rel_error(
            paged_kv.reference_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, window, softcap), ref)
        ok = mine == mine and mine < TOL[dtype]
        worst = max(worst, mine if mine == mine else float("inf"))
        p, _ = geo.plan_partitions(case.meta, "cuda")
        rows.append([name, len(qlens), int(sum(qlens)), int(max(slens)), p, f"{mine:.2e}", f"{theirs:.2e}",
                     f"{TOL[dtype]:.0e}", "ok" if ok else "FAIL"])
        log.append({"case": name, "rel_err": mine, "reference_rel_err": theirs, "ok": ok,
                    "seconds": time.perf_counter() - t0})
        print(rows[-1], flush=True)
    return worst


# ---------------------------------------------------------------- timing helpers


def random_pool(rng, seq_lens, hkv, d, bs, dtype, extra_blocks=0, shuffle=True):
    """Caches holding exactly the requests' blocks, physically shuffled (or in allocation order,
    as a fresh pool hands them out); random values made on the GPU."""
    per = [-(-int(s) // bs) for s in seq_lens]
    nb = sum(per) + extra_blocks
    perm = rng.permutation(nb) if shuffle else np.arange(nb)
    tables, at = [], 0
    for n in per:
        tables.append([int(x) for x in perm[at : at + n]])
        at += n
    kc = mx.random.normal((nb, bs, hkv, d)).astype(dtype)
    vc = mx.random.normal((nb, bs, hkv, d)).astype(dtype)
    mx.eval(kc, vc)
    return kc, vc, tables


HBM_CEILING = 4.3e12  # bytes/s: the H200 device-to-device copy rate the decode target is stated against


def hbm_bandwidth():
    """(bytes/s, sec, spread) of the faster of MLX's elementwise negate and a plain 16-byte copy
    kernel over 2 GiB (read + write), and the negate's and the copy's rates."""
    x = mx.random.normal((1024 // S, 1024, 1024)).astype(mx.bfloat16)  # 2 GiB
    mx.eval(x)
    sec, spread = bench(lambda: -x, iters=10, reps=7)
    rates = {"negate": 2 * x.nbytes / sec}
    if S == 1:
        copy = mx.fast.cuda_kernel(
            name="mlxd_copy16", input_names=["x"], output_names=["y"],
            source="const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;\n"
                   "if (i < N) reinterpret_cast<uint4*>(y)[i] = reinterpret_cast<const uint4*>(x)[i];\n")
        n = x.nbytes // 16
        csec, cspread = bench(lambda: copy(inputs=[x], template=[("N", n)], grid=(n, 1, 1), threadgroup=(256, 1, 1),
                                            output_shapes=[x.shape], output_dtypes=[x.dtype])[0], iters=10, reps=7)
        rates["copy"] = 2 * x.nbytes / csec
        if csec < sec:
            sec, spread = csec, cspread
    return 2 * x.nbytes / sec, sec, spread, rates


def interleaved(fns: dict, iters=20, reps=9) -> dict:
    """Median seconds per call of each variant; the variants alternate within every repetition in
    a fresh random order, so clock drift and the position in the sequence fall on all alike."""
    if S > 1:
        iters, reps = 1, 1
    for f in fns.values():
        mx.eval(f())
    times = {k: [] for k in fns}
    order = list(fns)
    shuffler = np.random.default_rng(0)
    for _ in range(reps):
        shuffler.shuffle(order)
        for k in order:
            times[k].append(timed(fns[k], iters)[1])
    return {k: statistics.median(v) for k, v in times.items()}


def prefill(title, lens, h, hkv, d, bs, dt, scale, rng, md, log, shuffle=True):
    """Fresh prefill chunks: the default route and its parts against SDPA on the padded batch
    (every prompt right-padded to the longest; with fresh chunks the causal mask alone is exact)."""
    n, longest = len(lens), max(lens)
    kc, vc, tables = random_pool(rng, lens, hkv, d, bs, dt, shuffle=shuffle)
    meta = AttentionMetadata.build(lens, lens, tables, bs)
    q = mx.random.normal((sum(lens), h, d)).astype(dt)
    qp = mx.random.normal((n, longest, h, d)).astype(dt).transpose(0, 2, 1, 3)  # as packed rows are read
    kp = mx.random.normal((n, hkv, longest, d)).astype(dt)
    vp = mx.random.normal((n, hkv, longest, d)).astype(dt)
    mx.eval(q, qp, kp, vp)
    out_k = kernel(q, kc, vc, meta, scale)
    out_r = paged_kv.reference_attention(q, kc, vc, meta, scale)
    perr = rel_error(out_k, out_r)
    plan = gpu._plan(meta, "cuda")
    layout = plan.context_layout(hkv, kc.shape[0])
    gathered = gpu.gather_runs("cuda", kc, vc, meta, layout) if layout.groups else None
    if gathered:
        mx.eval(gathered)

    def sdpa_parts():  # the route's SDPA calls alone, on K/V gathered beforehand
        contexts = gpu.run_contexts(plan, kc, vc, gathered)
        return [gpu._sdpa_run(q, k, v, where, r.query_len, scale)
                for r, where, (k, v) in zip(plan.routed()[2], plan.run_rows(), contexts)]

    def padded():
        return mx.fast.scaled_dot_product_attention(qp, kp, vp, scale=scale, mask="causal")

    variants = {"route": lambda: kernel(q, kc, vc, meta, scale), "padded": padded, "sdpa_parts": sdpa_parts}
    if gathered:
        variants["gather"] = lambda: gpu.gather_runs("cuda", kc, vc, meta, layout)
    equal = len(set(lens)) == 1
    sec = interleaved(variants)
    sec_r, _ = bench(lambda: paged_kv.reference_attention(q, kc, vc, meta, scale), iters=5, reps=3)
    useful = sum(4 * h * d * x * (x + 1) / 2 for x in lens)
    padded_flops = 4 * n * h * d * longest * (longest + 1) / 2
    host_us = timed(lambda: kernel(q, kc, vc, meta, scale), 100)[0] * 1e6
    runs = len(plan.routed()[2])
    read = sum(p is not None for p in plan.in_place(kc.shape[0]))
    rows = [("kernels.paged_attention (default route)", sec["route"])]
    if gathered:
        rows.append((f"of which: one gather of K and V for {runs - read} of {runs} SDPA run(s)", sec["gather"]))
    rows += [(f"of which: the {runs} SDPA call(s) alone ({read} reading the cache in place)", sec["sdpa_parts"]),
            ("reference (gather + SDPA per chunk)", sec_r),
            (f"mx.fast.scaled_dot_product_attention, padded batch [{n}, {h}, {longest}, {d}]", sec["padded"])]
    extra = ""
    if S == 1 and equal and shuffle:  # the slow tile path is timed once
        sec_t, _ = bench(lambda: gpu.paged_attention("cuda", q, kc, vc, meta, scale, route_chunks=False),
                         iters=3, reps=3)
        out_t = gpu.paged_attention("cuda", q, kc, vc, meta, scale, route_chunks=False)
        rows.insert(3, ("kernel tile path only (one launch)", sec_t))
        extra = f", tile path {rel_error(out_t, out_r):.1e}"
    md += [f"### Prefill: {title}, H={h}, H_kv={hkv}, D={d}, bf16 (useful causal FLOPs {useful / 1e9:.0f} G, "
           f"padded {padded_flops / 1e9:.0f} G)\n",
           "| path | ms | useful TFLOP/s | padded SDPA / this |", "|---|---|---|---|"]
    md += [f"| {name} | {t * 1e3:.3f} | {useful / t / 1e12:.1f} | {sec['padded'] / t:.2f}x |" for name, t in rows]
    md.append(f"\nError vs reference: default route {perr:.1e}{extra}. Host time to enqueue one route call "
              f"(plan cached for the step, as every layer after the first sees it): {host_us:.0f} us.\n")
    log.setdefault("prefill", []).append({"title": title, "lens": lens, "shuffle": shuffle, "err": perr,
                                          "host_us": host_us, "in_place_runs": read,
                                          "reference_sec": sec_r, **{k + "_sec": v for k, v in sec.items()}})
    print("\n".join(md[-(len(rows) + 4):]), flush=True)
    if equal and shuffle:
        sdpa_batch_efficiency(n, h, hkv, d, dt, scale, md, log)


def sdpa_batch_efficiency(n, h, hkv, d, dt, scale, md, log):
    """Fused SDPA's rate on one prompt against a batch of n: the SDPA route pays batch 1 on every
    run of ragged chunks."""
    fns, flops = {}, {}
    for length in (512 // S, 1024 // S, 2048 // S):
        for b in (1, n):
            qq = mx.random.normal((b, length, h, d)).astype(dt).transpose(0, 2, 1, 3)
            kk = mx.random.normal((b, hkv, length, d)).astype(dt)
            mx.eval(qq, kk)
            key = (b, length)
            fns[key] = lambda qq=qq, kk=kk: mx.fast.scaled_dot_product_attention(qq, kk, kk, scale=scale, mask="causal")
            flops[key] = 4 * b * h * d * length * (length + 1) / 2
    sec = interleaved(fns)
    md += [f"SDPA alone, causal, H={h}, H_kv={hkv}, D={d}: TFLOP/s by prompt length and batch\n",
           f"| prompt | batch 1 | batch {n} |", "|---|---|---|"]
    md += [f"| {length} | {flops[(1, length)] / sec[(1, length)] / 1e12:.0f} | "
           f"{flops[(n, length)] / sec[(n, length)] / 1e12:.0f} |" for length in sorted({k[1] for k in fns})]
    md.append("")
    log["sdpa_batch"] = [{"batch": b, "len": length, "sec": v} for (b, length), v in sec.items()]
    print("\n".join(md[-7:]), flush=True)


def run_prefill(h, hkv, d, bs, dt, scale, rng, md, log, flush) -> int:
    # -- prefill: 8 x 2K, then 8 ragged fresh prompts of 1K-2K (the padded batch pads them to 2K)
    nseq, ctx = 8, 2048 // S
    ragged = sorted(int(x) for x in rng.integers(ctx // 2, ctx + 1, size=nseq))
    ragged[-1] = ctx
    for title, lens, shuffle in (
            (f"{nseq} x {ctx} new tokens, blocks shuffled over the pool", [ctx] * nseq, True),
            (f"{nseq} x {ctx} new tokens, blocks in allocation order (as a fresh pool hands them out)",
             [ctx] * nseq, False),
            (f"{nseq} ragged fresh prompts {ragged}, blocks shuffled", ragged, True)):
        prefill(title, lens, h, hkv, d, bs, dt, scale, rng, md, log, shuffle)
        flush()

    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--only", choices=["decode", "prefill"], help="time one section only")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="exercise this script on the CPU: reference in place of the kernel, tiny sizes")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    global S
    if args.cpu_dry_run:
        S = 32

        # The GPU launches become the reference; planning, routing and assembly run as on the GPU.
        def launch(plan, q, kc, vc, scale, window, softcap):
            return paged_kv.reference_attention(q, kc, vc, plan.meta, scale, window, softcap)

        gpu._launch, gpu.gather_runs = launch, host_gather_runs
    else:
        assert mx.cuda.is_available(), "MLX has no CUDA device here"
        mx.set_default_device(mx.gpu)
    rng = np.random.default_rng()
    log: dict = {"mlx": mx.__version__}
    try:
        log["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem",
                                     "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        log["gpu"] = "?"
    md = [f"GPU: {log['gpu']}; MLX {mx.__version__} (CUDA backend)\n"]

    def flush():
        with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
            f.write("\n".join(md) + "\n")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(log, f, indent=1, default=str)

    # -- correctness
    if not args.skip_correctness:
        rows, clog = [], []
        log["correctness"] = clog
        try:
            worst = correctness(rng, rows, clog)
        except Exception:
            log["correctness_error"] = traceback.format_exc()
            print(log["correctness_error"], flush=True)
            worst = float("nan")
        md += ["## Correctness: CUDA kernel vs dense float32 oracle (||out-ref||/||ref||)\n",
               "| case | seqs | tokens | max ctx | KV parts | kernel err (worst of both routes) | reference err | tol | |",
               "|---|---|---|---|---|---|---|---|---|"]
        md += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        md.append(f"\nWorst kernel error: {worst:.2e}; NaN never passes.\n")
        flush()

    # -- HBM bandwidth
    bw, bw_sec, bw_spread, rates = hbm_bandwidth()
    log["hbm"] = {"bytes_per_s": bw, "sec": bw_sec, "spread": bw_spread, "rates": rates}
    md.append(f"## Timings\n\nMeasured HBM bandwidth over 2 GiB bf16, read + write: "
              f"**{bw / 1e12:.2f} TB/s** (" + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in rates.items()) +
              f"); the decode target's stated ceiling is {HBM_CEILING / 1e12:.1f} TB/s.\n")
    print(md[-1], flush=True)
    flush()

    h, hkv, d, bs, dt = 32, 8, 128, 16, mx.bfloat16
    scale = d ** -0.5
    if args.only == "prefill":
        return run_prefill(h, hkv, d, bs, dt, scale, rng, md, log, flush)

    # -- decode: 64 x 4K, H=32, H_kv=8, D=128, bf16
    nseq, ctx = 64, 4096 // S
    kc, vc, tables = random_pool(rng, [ctx] * nseq, hkv, d, bs, dt)
    meta = AttentionMetadata.build([1] * nseq, [ctx] * nseq, tables, bs)
    q = mx.random.normal((nseq, h, d)).astype(dt)
    kv_bytes = 2 * nseq * ctx * hkv * d * 2 + 2 * q.nbytes + meta.block_tables.nbytes
    bound = kv_bytes / bw
    err = rel_error(kernel(q, kc, vc, meta, scale), paged_kv.reference_attention(q, kc, vc, meta, scale))
    drows = []
    dlog = []
    saved = (geo.lanes_per_token, geo.decode_unroll, geo.PARTITION_TOKENS, geo.DECODE_ACC_SHARED,
             gpu.DECODE_MIN_GROUPS)
    default = (geo.lanes_per_token(d), geo.decode_unroll(geo.lanes_per_token(d)), geo.PARTITION_TOKENS,
               geo.DECODE_ACC_SHARED, gpu.DECODE_MIN_GROUPS)
    variants = [default] + [v for v in [(16, 8, 512, False, 0), (16, 8, 1024, True, 0), (16, 4, 512, True, 0),
                                        (16, 8, 1024, True, 5), (16, 4, 512, True, 6), (16, 16, 512, True, 0),
                                        (16, 16, 1024, True, 0), (8, 8, 512, True, 0), (8, 4, 512, True, 0),
                                        (8, 4, 1024, True, 0)] if v != default]
    for lpt, u, part_tokens, acc_shared, min_groups in variants:
        geo.lanes_per_token = lambda _d, _v=lpt: _v
        geo.decode_unroll = lambda _l, _v=u: _v
        geo.PARTITION_TOKENS = part_tokens
        geo.DECODE_ACC_SHARED = acc_shared
        gpu.DECODE_MIN_GROUPS = min_groups
        meta.plans.clear()
        p, _ = geo.plan_partitions(meta, "cuda")
        try:
            sec, spread = bench(lambda: kernel(q, kc, vc, meta, scale))
            e = rel_error(kernel(q, kc, vc, meta, scale), paged_kv.reference_attention(q, kc, vc, meta, scale))
        except Exception as exc:  # a variant that fails to build is reported, not fatal
            print(f"variant {lpt},{u},{part_tokens},{acc_shared},{min_groups}: {exc}", flush=True)
            continue
        mark = " (default)" if (lpt, u, part_tokens, acc_shared, min_groups) == default else ""
        drows.append([f"{lpt} lanes/token, {u} loads in flight per lane, {part_tokens}-token partitions (P={p}), "
                      f"accumulators in {'shared memory' if acc_shared else 'registers'}"
                      f"{f', launch bound {min_groups} groups/SM' if min_groups else ''}{mark}",
                      f"{sec * 1e6:.0f}", f"{kv_bytes / sec / 1e12:.2f}", f"{bound / sec:.0%}",
                      f"{kv_bytes / HBM_CEILING / sec:.0%}", f"{e:.1e}"])
        dlog.append({"lpt": lpt, "u": u, "partition": part_tokens, "acc_shared": acc_shared, "min_groups": min_groups, "P": p, "sec": sec,
                     "spread": spread, "err": e})
        print(drows[-1], flush=True)
    (geo.lanes_per_token, geo.decode_unroll, geo.PARTITION_TOKENS, geo.DECODE_ACC_SHARED,
     gpu.DECODE_MIN_GROUPS) = saved
    meta.plans.clear()
    sec, _ = bench(lambda: paged_kv.reference_attention(q, kc, vc, meta, scale), iters=5, reps=3)
    drows.append(["reference (gather + SDPA)", f"{sec * 1e6:.0f}", f"{kv_bytes / sec / 1e12:.2f}", f"{bound / sec:.0%}",
                  f"{kv_bytes / HBM_CEILING / sec:.0%}", ""])
    kd = mx.random.normal((nseq, hkv, ctx, d)).astype(dt)
    vd = mx.random.normal((nseq, hkv, ctx, d)).astype(dt)
    qd = q[:, :, None, :]
    sec, _ = bench(lambda: mx.fast.scaled_dot_product_attention(qd, kd, vd, scale=scale))
    drows.append(["SDPA on contiguous K/V (not paged)", f"{sec * 1e6:.0f}", f"{kv_bytes / sec / 1e12:.2f}",
                  f"{bound / sec:.0%}", f"{kv_bytes / HBM_CEILING / sec:.0%}", ""])
    del kd, vd
    log["decode"] = {"bytes": kv_bytes, "bound_sec": bound, "runs": dlog, "err_default": err}
    md += [f"### Decode: {nseq} seqs x {ctx} ctx, H={h}, H_kv={hkv}, D={d}, bf16, block {bs}\n",
           f"Bytes moved (K+V once, q, out, tables): {kv_bytes / 1e9:.3f} GB; bound at measured bandwidth "
           f"{bound * 1e6:.0f} us. Default-plan error vs reference {err:.1e}. Host time to build one "
           f"default call's graph (not in the times below): {timed(lambda: kernel(q, kc, vc, meta, scale), 50)[0] * 1e6:.0f} us.\n",
           "| variant | us | TB/s | of measured bound | of 4.3 TB/s bound | err vs reference |",
           "|---|---|---|---|---|---|"]
    md += ["| " + " | ".join(r) + " |" for r in drows]
    md.append("")
    print("\n".join(md[-len(drows) - 5:]), flush=True)
    flush()

    if args.only == "decode":
        return 0

    # -- KV write (slot_mapping scatter) at the decode step's shape
    k_new = mx.random.normal((nseq, hkv, d)).astype(dt)
    v_new = mx.random.normal((nseq, hkv, d)).astype(dt)
    # The decode step's slots, each sequence's last position (overwritten: same cost as a new token).
    sec_keep, _ = bench(lambda: write_kv(kc, vc, k_new, v_new, meta), iters=5, reps=3)
    # The engine's pattern: the layer's cache is replaced by the scatter's result, so no
    # other reference holds the old buffer and MLX may update it in place.
    state = [kc, vc]
    kc = vc = None
    chain = []
    for _ in range(5):
        mx.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            state[0], state[1] = write_kv(state[0], state[1], k_new, v_new, meta)
        mx.eval(state)
        mx.synchronize()
        chain.append((time.perf_counter() - t0) / 20)
    sec_chain = statistics.median(chain)
    kc, vc = state
    attn_sec = min(r["sec"] for r in dlog)
    md += ["### KV write (MLX scatter by slot_mapping), decode step of 64 tokens\n",
           "| how | us | vs attention |", "|---|---|---|",
           f"| caller keeps the old cache alive (scatter must copy the cache) | {sec_keep * 1e6:.0f} | {sec_keep / attn_sec:.1f}x |",
           f"| cache replaced by the result (as the engine does) | {sec_chain * 1e6:.0f} | {sec_chain / attn_sec:.2f}x |", ""]
    log["kv_write"] = {"keep_sec": sec_keep, "chain_sec": sec_chain}
    print("\n".join(md[-6:]), flush=True)
    flush()
    del kc, vc, state

    run_prefill(h, hkv, d, bs, dt, scale, rng, md, log, flush)

    # -- mixed batches: one call vs its decode and prefill parts called separately
    mixed = [
        ("64 decode rows at 4K + 4 prefill chunks of 512 after 1536 cached", [4096 // S] * 64, [512 // S] * 4,
         [2048 // S] * 4),
        ("64 decode rows at 4K + 16 verify windows of 4 + 2 chunks of 32 (all in one launch)",
         [4096 // S] * 64, [4] * 16 + [32] * 2, [4 + 1024 // S] * 16 + [32 + 512 // S] * 2),
    ]
    log["mixed"] = []
    for title, dec_lens, pre_q, pre_ctx in mixed:
        kc, vc, tables = random_pool(rng, dec_lens + pre_ctx, hkv, d, bs, dt)
        nd = len(dec_lens)
        qlens = [1] * nd + pre_q
        meta_mix = AttentionMetadata.build(qlens, dec_lens + pre_ctx, tables, bs)
        meta_dec = AttentionMetadata.build([1] * nd, dec_lens, tables[:nd], bs)
        meta_pre = AttentionMetadata.build(pre_q, pre_ctx, tables[nd:], bs)
        q = mx.random.normal((sum(qlens), h, d)).astype(dt)
        q_dec, q_pre = q[:nd], q[nd:]
        mx.eval(q_dec, q_pre)
        rows_md = []
        entry = {"title": title}
        for label, route in (("default", True), ("tile path only", False)):
            def call(qq, mm, _r=route):
                return gpu.paged_attention("cuda", qq, kc, vc, mm, scale, route_chunks=_r)
            err = rel_error(call(q, meta_mix), paged_kv.reference_attention(q, kc, vc, meta_mix, scale))
            s_mix, _ = bench(lambda: call(q, meta_mix), iters=10, reps=5)
            s_both, _ = bench(lambda: [call(q_dec, meta_dec), call(q_pre, meta_pre)], iters=10, reps=5)
            s_dec, _ = bench(lambda: call(q_dec, meta_dec), iters=10, reps=5)
            s_pre, _ = bench(lambda: call(q_pre, meta_pre), iters=10, reps=5)
            rows_md.append(f"| {label} | {s_mix * 1e6:.0f} | {s_dec * 1e6:.0f} | {s_pre * 1e6:.0f} | "
                           f"{s_both * 1e6:.0f} | {s_both / s_mix:.2f}x | {err:.1e} |")
            entry[label] = {"mixed": s_mix, "dec": s_dec, "pre": s_pre, "both": s_both, "err": err}
        s_ref, _ = bench(lambda: paged_kv.reference_attention(q, kc, vc, meta_mix, scale), iters=5, reps=3)
        entry["reference"] = s_ref
        log["mixed"].append(entry)
        md += [f"### Mixed batch: {title}\n",
               "| path | mixed, one call (us) | decode part (us) | prefill part (us) | parts back to back (us) "
               "| parts / mixed | err vs reference |", "|---|---|---|---|---|---|---|"] + rows_md
        md.append(f"\nReference on the mixed batch: {s_ref * 1e6:.0f} us.\n")
        print("\n".join(md[-6:]), flush=True)
        flush()
        del kc, vc, q, q_dec, q_pre
    return 0


if __name__ == "__main__":
    sys.exit(main())
