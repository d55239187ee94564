"""The LoRA term of a projection group, fused with its base output into one CUDA kernel launch.

``lora_output(x, a, b, y, slots, rank)`` returns ``y + x·A[slot]·B[slot]``
row by row, each row with its own slot's adapter (slot 0: the base, no term),
in one launch. Written with MLX operations the same term is a matmul over
every resident slot's A, a masking multiply and one ``addmm`` (the CPU's
path, ``engined/lora/groups.py``), and on an H200 a decode step is bound by
the host's cost per launched operation, not by the term's few MFLOP
(bench/lora_results.md). A group of joined projections (q/k/v, gate/up) is
one projection of rank ``n * R`` to it, whose B is block-diagonal.

Layouts, as ``engined/lora/groups.py`` stores them: ``a`` ``[in, S * R]``
(slot ``s``: columns ``(s - 1) * R`` onwards), ``b`` ``[S * R, out]`` (slot
``s``: rows ``(s - 1) * R`` onwards), ``x`` ``[rows, in]``, ``y`` ``[rows,
out]``, ``slots`` ``[rows]`` uint32.

Work split: one thread group of 256 per (row, tile of 1 024 outputs). It
first forms its row's ``R`` values ``x·A`` for its slot, threads striding the
input in ``256 / R`` lanes per column (a lane's ``R`` neighbours read one
contiguous run of A), each thread with ``UNROLL`` sums in flight, summed
through shared memory; then each thread adds ``Σ_r h_r B[r, o]`` to 4
outputs, reading B and y along the row. The ``x·A`` of a row is formed once
per tile: redundant arithmetic (a few hundred multiply-adds per thread) bought
to avoid a second launch. A row on the base copies its outputs.

CUDA only: Metal runs the MLX operations until this source is compiled on a
Mac. Accumulation is in float32 whatever the weights' dtype.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

THREADS = 256
TILE = 1024  # outputs per thread group: 4 per thread
UNROLL = 8  # loads of A in flight per thread in the x·A phase
MAX_RANK = THREADS  # a rank's columns each take at least one thread

_SOURCE = f"""
  __shared__ float part[{THREADS}];
  __shared__ float h[R];
  const int tid = threadIdx.x;
  const int out = y_shape[1];
  const int per_row = (out + TILE - 1) / TILE;
  const int row = blockIdx.x / per_row;
  const int tile = blockIdx.x % per_row;
  const unsigned int slot = slots[row];
  const int lo = tile * TILE;
  const int hi = min(lo + TILE, out);
  const T* y_row = y + (size_t)row * out;
  T* z_row = z + (size_t)row * out;
  if (slot == 0) {{
    for (int o = lo + tid; o < hi; o += {THREADS}) z_row[o] = y_row[o];
    return;
  }}
  const int n_in = x_shape[1];
  const int lanes = {THREADS} / R;
  const int r = tid % R;
  const int lane = tid / R;
  const int width = a_shape[1];
  const int col = ((int)slot - 1) * R + r;
  // U independent sums, so that U loads of A are in flight per thread rather than one at a time:
  // the loop is a chain of global loads, and its latency, not its arithmetic, is this phase's time.
  float acc[U];
#pragma unroll
  for (int u = 0; u < U; ++u) acc[u] = 0.0f;
  if (lane < lanes) {{
    const T* x_row = x + (size_t)row * n_in;
    const T* a_col = a + col;
    int k = lane;
    for (; k + (U - 1) * lanes < n_in; k += U * lanes) {{
#pragma unroll
      for (int u = 0; u < U; ++u) {{
        const int kk = k + u * lanes;
        acc[u] += static_cast<float>(x_row[kk]) * static_cast<float>(a_col[(size_t)kk * width]);
      }}
    }}
    for (; k < n_in; k += lanes) acc[0] += static_cast<float>(x_row[k]) * static_cast<float>(a_col[(size_t)k * width]);
  }}
  float total = 0.0f;
#pragma unroll
  for (int u = 0; u < U; ++u) total += acc[u];
  part[tid] = total;
  __syncthreads();
  if (tid < R) {{
    float s = 0.0f;
    for (int j = 0; j < lanes; ++j) s += part[j * R + tid];
    h[tid] = s;
  }}
  __syncthreads();
  const T* b_slot = b + (size_t)((int)slot - 1) * R * out;
  for (int o = lo + tid; o < hi; o += {THREADS}) {{
    float v = static_cast<float>(y_row[o]);
#pragma unroll
    for (int q = 0; q < R; ++q) v += h[q] * static_cast<float>(b_slot[(size_t)q * out + o]);
    z_row[o] = static_cast<T>(v);
  }}
"""


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(name="mlxd_lora", input_names=["x", "a", "slots", "b", "y"], output_names=["z"],
                               source=_SOURCE)


def lora_output(x: mx.array, a: mx.array, b: mx.array, y: mx.array, slots: mx.array, rank: int) -> mx.array:
    """``y + (x @ A[slot]) @ B[slot]`` row by row (see the module's docstring for layouts); ``rank`` at most
    ``MAX_RANK``."""
    tiles = -(-y.shape[1] // TILE)
    return _kernel()(
        inputs=[x, a, slots, b, y],
        template=[("T", x.dtype), ("R", rank), ("TILE", TILE), ("U", UNROLL)],
        grid=(x.shape[0] * tiles * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[y.shape],
        output_dtypes=[y.dtype],
    )[0]
