"""The LoRA term of the projections that read one input, fused into one CUDA kernel per input.

``lora_outputs(x, a, bs, ys, slots, rank)`` returns ``ys[i] + x·A_i[slot]·B_i[slot]``
for every member ``i`` of a group (q/k/v, gate/up, or one projection alone),
each row with its own slot's adapter (slot 0: the base, no term), in one
launch. Written with MLX operations the same term is a matmul over every
resident slot's A, a masking multiply and one ``addmm`` per member (the
CPU's path, ``engined/lora``): ``2 + n`` operations per group, 15 per llama
layer, and on an H200 a decode step is bound by the host's cost per launched
operation, not by the term's few MFLOP (bench/lora_results.md). Here it is 4
launches per layer.

Layouts, as ``engined/lora`` stores them: ``a`` ``[in, n * S * R]`` (member
``i``, slot ``s``: columns ``(i * S + s - 1) * R`` onwards), ``bs[i]``
``[S * R, out_i]`` (slot ``s``: rows ``(s - 1) * R`` onwards), ``x``
``[rows, in]``, ``ys[i]`` ``[rows, out_i]``, ``slots`` ``[rows]`` uint32.

Work split: one thread group of 256 per (row, member, tile of 1 024 outputs).
It first forms its row's ``R`` values ``x·A`` for its member and slot, threads
striding the input in ``256 / R`` lanes per column (a lane's ``R`` neighbours
read one contiguous run of A), each thread with ``UNROLL`` sums in flight,
summed through shared memory; then each thread
adds ``Σ_r h_r B[r, o]`` to 4 outputs, reading B and y along the row. The
``x·A`` of a row is formed once per tile: redundant arithmetic (a few hundred
multiply-adds per thread) bought to avoid a second launch. A row on the base
copies its outputs.

CUDA only: Metal runs the MLX operations until this source is compiled on a
Mac. Accumulation is in float32 whatever the weights' dtype.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

THREADS = 256
TILE = 1024  # outputs per thread group: 4 per thread
UNROLL = 8  # loads of A in flight per thread in the x·A phase


def _source(n: int) -> str:
    """The kernel body for a group of ``n`` members (inputs ``b0..``, ``y0..``; outputs ``z0..``)."""
    pick = "\n".join(
        f"  if (m == {i}) {{ b = b{i}; y = y{i}; z = z{i}; out = y{i}_shape[1]; }}" for i in range(n))
    tiles = " + ".join(f"(y{i}_shape[1] + TILE - 1) / TILE" for i in range(n))
    member = "\n".join(
        f"  if (m < 0) {{ if (rest < (y{i}_shape[1] + TILE - 1) / TILE) {{ m = {i}; }} "
        f"else {{ rest -= (y{i}_shape[1] + TILE - 1) / TILE; }} }}" for i in range(n))
    return f"""
  __shared__ float part[{THREADS}];
  __shared__ float h[R];
  const int tid = threadIdx.x;
  const int per_row = {tiles};
  const int row = blockIdx.x / per_row;
  int rest = blockIdx.x % per_row;
  int m = -1;
{member}
  const int tile = rest;
  const T* b = b0;
  const T* y = y0;
  T* z = z0;
  int out = y0_shape[1];
{pick}
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
  const int col = (m * NS + (int)slot - 1) * R + r;
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
def _kernel(n: int):
    return mx.fast.cuda_kernel(
        name=f"mlxd_lora_{n}",
        input_names=["x", "a", "slots"] + [f"b{i}" for i in range(n)] + [f"y{i}" for i in range(n)],
        output_names=[f"z{i}" for i in range(n)],
        source=_source(n),
    )


MAX_RANK = THREADS  # a rank's columns each take at least one thread


def lora_outputs(x: mx.array, a: mx.array, bs: list[mx.array], ys: list[mx.array], slots: mx.array,
                 rank: int) -> list[mx.array]:
    """Each ``ys[i] + (x @ A_i[slot]) @ B_i[slot]`` row by row (see the module's docstring for layouts);
    ``rank`` at most ``MAX_RANK``."""
    n = len(bs)
    rows = x.shape[0]
    num_adapters = bs[0].shape[0] // rank
    tiles = sum(-(-y.shape[1] // TILE) for y in ys)
    return _kernel(n)(
        inputs=[x, a, slots, *bs, *ys],
        template=[("T", x.dtype), ("R", rank), ("NS", num_adapters), ("TILE", TILE), ("U", UNROLL)],
        grid=(rows * tiles * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[y.shape for y in ys],
        output_dtypes=[y.dtype for y in ys],
    )
