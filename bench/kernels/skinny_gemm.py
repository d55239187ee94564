"""Would a decode step's projections at a few rows be cheaper in a kernel of our own than through cuBLASLt?

On the H200, MLX 0.32.4 runs a matmul of more than one row through cuBLASLt and
builds its descriptors and queries its algorithm heuristic at every evaluation:
~15 us of host a matmul, 145 a decode step of Qwen3-8B's shape
(``bench/host_step_results.md``), in a step that the host bounds at c = 16
(``bench/gpu_serving_results.md``, run 8). A kernel launched through
``mx.fast.cuda_kernel`` skips that; whether its device time (CUDA cores, no
matrix units) stays under the host time it saves is what this measures.

The kernel: ``out[M, N] = x[M, K] @ w[N, K]^T`` for M <= 16 rows. A warp owns
``NPW`` consecutive outputs; its lanes walk K eight elements at a time (one
16-byte load of each of its ``NPW`` weight rows, then each row of ``x``), with
``M * NPW`` float accumulators, reduced across the warp at the end. Every
weight is read once; ``x`` (a few KiB a row) is read by every warp from the
caches.

Per shape and row count: the largest error against ``x @ w.T`` (relative to the
largest output), then one "step" (the four projections of each of 36 layers, each
layer its own weights, one evaluation) through ``mx.matmul`` and through the
kernel, alternating, median milliseconds.

    python bench/kernels/skinny_gemm.py [--rows 2 4 8 16] [--npw 4 8] [--repeats 10]

Needs MLX's CUDA back-end; ``bench/kernels/nvcc_check.py`` compiles the kernel without a GPU.

Measured on the H200 (``bench/lora_results.md``, 2026-12-04): 1.04-1.08x ``mx.matmul``'s step time
at 2 rows, 1.29-1.33x at 8 and 1.97-2.13x at 16. It loses more in device time than it saves on the
host.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import lru_cache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mlx.core as mx  # noqa: E402

from bench.kernels.on_cuda import alternating_ms, seeded_cuda  # noqa: E402

SOURCE = r"""
  constexpr int WARPS = 4;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int n0 = (blockIdx.x * WARPS + warp) * NPW;
  if (n0 >= N) return;
  float acc[M][NPW];
#pragma unroll
  for (int m = 0; m < M; ++m)
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
    for (int m = 0; m < M; ++m) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
      const T* e = reinterpret_cast<const T*>(&raw);
      float xv[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) xv[i] = static_cast<float>(e[i]);
#pragma unroll
      for (int j = 0; j < NPW; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[m][j] += xv[i] * wv[j][i];
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int j = 0; j < NPW; ++j) {
      float v = acc[m][j];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == ((m * NPW + j) & 31)) out[(size_t)m * N + n0 + j] = static_cast<T>(v);
    }
"""

# Qwen3-8B's projections of one layer, (out, in): q/k/v joined, o, gate/up joined, down.
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
LAYERS = 36


@lru_cache(maxsize=None)
def kernel():
    return mx.fast.cuda_kernel(name="bench_skinny_gemm", input_names=["x", "w"], output_names=["out"], source=SOURCE)


def skinny(x: mx.array, w: mx.array, npw: int) -> mx.array:
    """``x @ w.T`` for ``x [M, K]``, ``w [N, K]`` (K a multiple of 256, N of ``4 * npw``)."""
    m, k = x.shape
    n = w.shape[0]
    return kernel()(inputs=[x, w], template=[("T", x.dtype), ("M", m), ("K", k), ("N", n), ("NPW", npw)],
                    grid=(n // npw * 32, 1, 1), threadgroup=(128, 1, 1), output_shapes=[(m, n)],
                    output_dtypes=[x.dtype])[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--npw", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if not seeded_cuda():
        return 1
    weights = [[(mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16) for n, k in SHAPES] for _ in range(LAYERS)]
    mx.eval(weights)
    print("| rows | NPW | largest error | step, mx.matmul (ms) | step, kernel (ms) | kernel / matmul |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        xs = {k: mx.random.normal((rows, k)).astype(mx.bfloat16) for _, k in SHAPES}
        mx.eval(xs)
        for npw in args.npw:
            err = 0.0
            for w in weights[0]:
                want = (xs[w.shape[1]] @ w.T).astype(mx.float32)
                got = skinny(xs[w.shape[1]], w, npw).astype(mx.float32)
                err = max(err, (mx.abs(got - want).max() / mx.abs(want).max()).item())
            runs = {"matmul": lambda: [xs[w.shape[1]] @ w.T for layer in weights for w in layer],
                    "kernel": lambda: [skinny(xs[w.shape[1]], w, npw) for layer in weights for w in layer]}
            med = alternating_ms(runs, args.repeats)
            a, b = med["matmul"], med["kernel"]
            print(f"| {rows} | {npw} | {err:.1e} | {a:.2f} | {b:.2f} | {b / a:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
