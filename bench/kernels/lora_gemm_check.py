"""The LoRA group kernel (``engined.kernels.gemm_with_term``) against what it replaces, on CUDA.

A decode step's folded group is two launches through MLX: the matmul of the
folded weight (base outputs and every slot's ``x·A``, through cuBLASLt) and
the term kernel (``add_term``); ``gemm_with_term`` is one. Per row count:

- the largest error of each against a float32 reference (``x @ W.T`` plus
  each row's own slot's ``(x @ A_s) @ B_s``), relative to the largest output;
- one "step", the four groups of each of Llama-3.1-8B's 32 layers (q/k/v,
  o, gate/up, down; every layer its own weights, 4 slots of rank 16, rows
  round-robin over the base and the 4 adapters), one evaluation, median
  milliseconds of the base matmuls alone (the base model's step), of the
  matmul and term, and of the one kernel, alternating.

    python bench/kernels/lora_gemm_check.py [--rows 1 4 8 16] [--warps 8 4] [--repeats 10]

Measured on the H200 (``bench/lora_results.md``, 2026-12-04): as exact as the two launches, and
2.2-4.8x their time at 8-16 rows. Every block sums its rows' ``x·A`` again and so reads ``rows x R``
rows of A for a tile of 32-64 outputs. The engine keeps the two launches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mlx.core as mx  # noqa: E402

from functools import lru_cache  # noqa: E402

from engined.kernels import lora_term  # noqa: E402

# Grid: x the tiles (``WARPS`` warps of ``NPW`` outputs each), one block each. ``w`` is the folded weight:
# ``N`` base rows, then slot ``s``'s ``WD`` rows of A (member ``i``'s ``R`` at ``i * R``); ``b`` the group's B.
# ``MP`` bounds the rows (``x_shape[0]``), the accumulators' size.
GEMM_SOURCE = r"""
  constexpr int TILE = WARPS * NPW;
  constexpr int HR = R < 16 ? R : 16;  // h columns a warp sums at once
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int rows = x_shape[0];
  const int j0 = blockIdx.x * TILE;  // a tile never straddles two members
  const int member = (j0 >= OFF1) + (j0 >= OFF2);
  __shared__ float hs[MP][R];
  __shared__ int arow[MP];
  if (threadIdx.x < MP) {
    const uint32_t s = (int)threadIdx.x < rows ? slots[threadIdx.x] : 0u;
    arow[threadIdx.x] = s > 0 ? N + (int)(s - 1) * WD + member * R : -1;
  }
  __syncthreads();
  // Phase 1: this block's member's h = x_t . A[slot_t] for every row, HR columns a warp at a time.
  for (int u = warp; u < rows * (R / HR); u += WARPS) {
    const int t = u / (R / HR), r0 = (u % (R / HR)) * HR;
    const int a0 = arow[t];
    if (a0 < 0) {
      if (lane < HR) hs[t][r0 + lane] = 0.0f;
      continue;
    }
    float hacc[HR];
#pragma unroll
    for (int i = 0; i < HR; ++i) hacc[i] = 0.0f;
    for (int k = lane * 8; k < K; k += 32 * 8) {
      const uint4 xr = *reinterpret_cast<const uint4*>(x + (size_t)t * K + k);
      const T* xe = reinterpret_cast<const T*>(&xr);
      float xv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) xv[e] = static_cast<float>(xe[e]);
#pragma unroll
      for (int i = 0; i < HR; ++i) {
        const uint4 ar = *reinterpret_cast<const uint4*>(w + (size_t)(a0 + r0 + i) * K + k);
        const T* ae = reinterpret_cast<const T*>(&ar);
#pragma unroll
        for (int e = 0; e < 8; ++e) hacc[i] += xv[e] * static_cast<float>(ae[e]);
      }
    }
#pragma unroll
    for (int i = 0; i < HR; ++i) {
      float v = hacc[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == i) hs[t][r0 + i] = v;
    }
  }
  __syncthreads();
  // Phase 2: the base outputs of this warp's NPW columns for every row, then each row's term.
  const int n0 = j0 + warp * NPW;
  float acc[MP][NPW];
#pragma unroll
  for (int m = 0; m < MP; ++m)
#pragma unroll
    for (int j = 0; j < NPW; ++j) acc[m][j] = 0.0f;
  for (int k = lane * 8; k < K; k += 32 * 8) {
    float wv[NPW][8];
#pragma unroll
    for (int j = 0; j < NPW; ++j) {
      const uint4 raw = *reinterpret_cast<const uint4*>(w + (size_t)(n0 + j) * K + k);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) wv[j][i] = static_cast<float>(e[i]);
    }
#pragma unroll
    for (int m = 0; m < MP; ++m) {
      if (m < rows) {
        const uint4 raw = *reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float xv = static_cast<float>(e[i]);
#pragma unroll
          for (int j = 0; j < NPW; ++j) acc[m][j] += xv * wv[j][i];
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MP; ++m)
#pragma unroll
    for (int j = 0; j < NPW; ++j) {
      float v = acc[m][j];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (m < rows && lane == ((m * NPW + j) & 31)) {
        const int a0 = arow[m];
        if (a0 >= 0) {
          const T* b_ = b + (size_t)(a0 - N) * LDB + n0 + j;
#pragma unroll
          for (int r = 0; r < R; ++r) v += hs[m][r] * static_cast<float>(b_[(size_t)r * LDB]);
        }
        out[(size_t)m * N + n0 + j] = static_cast<T>(v);
      }
    }
"""


@lru_cache(maxsize=None)
def gemm_kernel():
    return mx.fast.cuda_kernel(name="mlxd_lora_gemm", input_names=["x", "w", "b", "slots"], output_names=["out"],
                               source=GEMM_SOURCE)


def gemm_warps(offsets: list[int], k: int, rank: int, dtype: mx.Dtype) -> int | None:
    """Warps a block of ``gemm_with_term`` for a group of these member ``offsets`` (``[0, .., N]``), input
    width ``k`` and ``rank``, or None where the kernel cannot take it: a dtype not of two bytes (its loads
    take eight elements), ``k`` not a multiple of 256 (a warp's stride), a rank past 16 not a multiple of 16,
    more than three members, or a member boundary no tile of 8 outputs meets."""
    if dtype.size != 2 or k % 256 or (rank > 16 and rank % 16) or len(offsets) > 4:
        return None
    for warps in (8, 4, 2, 1):
        if all(o % (warps * 8) == 0 for o in offsets):
            return warps
    return None


def gemm_with_term(x: mx.array, w: mx.array, b: mx.array, slots: mx.array, offsets: list[int], rank: int,
                   warps: int) -> mx.array:
    """``[rows, N]`` (``N = offsets[-1]``): ``x @ w[:N].T`` plus each row's own slot's term, for a folded
    group (``engined/lora/groups.py``: ``w``'s rows past ``N`` are the slots' A, ``b`` their B); ``x`` 2-D,
    row-contiguous, at most ``GEMM_ROWS`` rows; ``warps`` from ``gemm_warps``."""
    rows, k = x.shape
    n = offsets[-1]
    mp = next(m for m in (2, 4, 8, 16) if rows <= m)
    npw = 8 if mp <= 8 else 4  # sixteen rows' accumulators take half the outputs a warp
    bounds = (offsets[1:-1] + [n, n])[:2]
    return gemm_kernel()(
        inputs=[x, w, b, slots],
        template=[("T", x.dtype), ("MP", mp), ("K", k), ("N", n), ("WD", (len(offsets) - 1) * rank), ("R", rank),
                  ("NPW", npw), ("WARPS", warps), ("OFF1", bounds[0]), ("OFF2", bounds[1]), ("LDB", b.shape[1])],
        grid=(n // npw * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype])[0]


# Llama-3.1-8B's groups: member widths and input width.
GROUPS = [((4096, 1024, 1024), 4096), ((4096,), 4096), ((14336, 14336), 4096), ((4096,), 14336)]
LAYERS = 32
SLOTS = 4
RANK = 16


def make_group(members: tuple[int, ...], k: int) -> dict:
    """A folded group's arrays as ``ProjectionGroup`` lays them out: ``w`` the base rows then the slots' A
    rows, ``b`` block-diagonal (member ``i``'s rows reach only its outputs), zeros past the base outputs."""
    offsets = [sum(members[:i]) for i in range(len(members) + 1)]
    n, wd = offsets[-1], len(members) * RANK
    w = mx.random.normal((n + SLOTS * wd, k)) * 0.02
    b = mx.zeros((SLOTS * wd, n + SLOTS * wd))
    for s in range(SLOTS):
        for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            r0 = s * wd + i * RANK
            b[r0:r0 + RANK, lo:hi] = mx.random.normal((RANK, hi - lo)) * 0.05
    w = w.astype(mx.bfloat16)
    # The base model's own weight: the folded one's first rows, an array of its own (no slice in the step).
    return dict(w=w, base=w[:n], b=b.astype(mx.bfloat16), offsets=offsets, wd=wd)


def reference(x: mx.array, g: dict, slots: list[int]) -> mx.array:
    n, wd = g["offsets"][-1], g["wd"]
    x32, w32, b32 = (a.astype(mx.float32) for a in (x, g["w"], g["b"]))
    y = x32 @ w32[:n].T
    rows = []
    for t, s in enumerate(slots):
        row = y[t]
        if s:
            h = x32[t] @ w32[n + (s - 1) * wd:n + s * wd].T
            row = row + h @ b32[(s - 1) * wd:s * wd, :n]
        rows.append(row)
    return mx.stack(rows)


def two_launches(x, g, slots_arr):
    n = g["offsets"][-1]
    z = x @ g["w"].T
    return lora_term.add_term(z, z, n, g["b"], slots_arr, g["wd"], n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--warps", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if not mx.cuda.is_available():
        print("needs MLX's CUDA back-end")
        return 1
    mx.random.seed(0)
    print("seed 0")
    layers = []
    for _ in range(LAYERS):
        layers.append([make_group(m, k) for m, k in GROUPS])
        mx.eval([[g["w"], g["base"], g["b"]] for g in layers[-1]])
    print("| rows | warps | error, matmul + term | error, one kernel | step, base matmuls (ms) "
          "| step, matmul + term (ms) | step, one kernel (ms) | one kernel / matmul + term | base / one kernel |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        slots = [t % (SLOTS + 1) for t in range(rows)]
        slots_arr = mx.array(slots, dtype=mx.uint32)
        xs = {k: mx.random.normal((rows, k)).astype(mx.bfloat16) for _, k in GROUPS}
        mx.eval(xs)
        for warps in args.warps:
            errs = [0.0, 0.0]
            for g, (_, k) in zip(layers[0], GROUPS):
                want = reference(xs[k], g, slots)
                scale = mx.abs(want).max()
                got = [two_launches(xs[k], g, slots_arr),
                       gemm_with_term(xs[k], g["w"], g["b"], slots_arr, g["offsets"], RANK, warps)]
                for i, y in enumerate(got):
                    errs[i] = max(errs[i], (mx.abs(y.astype(mx.float32) - want).max() / scale).item())
            runs = {
                "base": lambda: [xs[k] @ g["base"].T for layer in layers
                                 for g, (_, k) in zip(layer, GROUPS)],
                "two": lambda: [two_launches(xs[k], g, slots_arr) for layer in layers
                                for g, (_, k) in zip(layer, GROUPS)],
                "one": lambda: [gemm_with_term(xs[k], g["w"], g["b"], slots_arr, g["offsets"], RANK, warps)
                                for layer in layers for g, (_, k) in zip(layer, GROUPS)],
            }
            times = {name: [] for name in runs}
            for i in range(args.repeats + 1):
                for name, run in runs.items():
                    start = time.perf_counter()
                    mx.eval(run())
                    if i:
                        times[name].append((time.perf_counter() - start) * 1e3)
            base, two, one = (statistics.median(times[name]) for name in ("base", "two", "one"))
            print(f"| {rows} | {warps} | {errs[0]:.1e} | {errs[1]:.1e} | {base:.2f} | {two:.2f} | {one:.2f} "
                  f"| {one / two:.2f}x | {base / one:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
