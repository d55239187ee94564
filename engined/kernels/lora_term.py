"""A LoRA group's term added to its base output in one CUDA kernel, for a decode step's few rows.

A group's output is ``y + (h * mask) @ B`` (``engined/lora/groups.py``): ``h``
every resident slot's ``x·A`` columns, ``mask`` each row's own slot's. Through
MLX that is a multiply and an ``addmm``, and MLX's CUDA backend builds an
``addmm``'s cuBLASLt descriptors and asks cuBLASLt's heuristic for an
algorithm at every evaluation: a host cost that a decode step, bound by the
host, pays once per group per layer (``bench/lora_results.md``). Here one
thread per (row, output column) reads only its row's own slot's ``W``
columns of ``h`` and rows of ``B``: no mask, no matmul library, one launch.

Rows past ``MAX_ROWS`` (prefill chunks) keep MLX's operations: there the
matrix units are worth the call's cost, and each row here reads its slot's
``B`` (``W x OUT``) on its own.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from mlxd.engined.kernels.source import CUDA_TYPES

MAX_ROWS = 128
_THREADS = 256
VECTOR = 4  # output columns a thread takes, its y, B and output read and written four at a time

# Grid: x the output columns (``VECTOR`` a thread), y the rows. A thread per column issued a load instruction per
# B value and per h value, and the load instructions bounded the kernel: under ncu, 13.8 us for q/k/v and 35 us
# for gate/up at 64 rows, against their matmuls' 17-18 and 63-70 (``bench/lora_results.md``). Here one h load
# serves ``VECTOR`` columns, and B's are one wide load each. ``h`` is read from column ``HOFF`` on, so that a folded
# group passes its one base output as both ``y`` and ``h``. The leading dimensions are the arrays' shapes, passed
# at launch. With ``GLU`` (a gate/up group, gate's ``OUT`` columns then up's) a thread also sums up's columns, ``OUT``
# further on in ``y`` and B, and writes ``silu(gate) * up``: the MLP's activation in the same launch, one kernel
# fewer a layer. With a residual ``r`` (``[rows, OUT]``: the block's input, where the group's output is what the
# block adds to it) the thread adds its row of ``r`` too, and the block's addition is saved.
# ``T``, ``W``, ``OUT``, ``HOFF`` and ``GLU`` are written into each group's own copy of the source
# (``source``), not passed as template arguments: MLX formats every template argument into the kernel's text and
# its name at every call, a host cost paid ~128 times a step (``bench/kernels/launch_cost.py``).
_SOURCE = f"  constexpr int V = {VECTOR};" + r"""
  struct alignas(V * sizeof(T)) Pack { T v[V]; };
  const int j = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  const int t = blockIdx.y;
  if (j >= OUT) return;
  const int ldy = y_shape[1], ldh = h_shape[1], nb = b_shape[1];
  float acc[V], up[V];
  const Pack yv = *reinterpret_cast<const Pack*>(y + (size_t)t * ldy + j);
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = static_cast<float>(yv.v[i]);
  if (GLU) {
    const Pack uv = *reinterpret_cast<const Pack*>(y + (size_t)t * ldy + OUT + j);
#pragma unroll
    for (int i = 0; i < V; ++i) up[i] = static_cast<float>(uv.v[i]);
  }
  const uint32_t s = slots[t];
  if (s > 0) {
    const int c0 = (int)(s - 1) * W;
    const T* h_ = h + (size_t)t * ldh + HOFF + c0;
    const T* b_ = b + (size_t)c0 * nb + j;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float hk = static_cast<float>(h_[k]);
      const Pack bv = *reinterpret_cast<const Pack*>(b_ + (size_t)k * nb);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += hk * static_cast<float>(bv.v[i]);
      if (GLU) {
        const Pack bu = *reinterpret_cast<const Pack*>(b_ + (size_t)k * nb + OUT);
#pragma unroll
        for (int i = 0; i < V; ++i) up[i] += hk * static_cast<float>(bu.v[i]);
      }
    }
  }
  // residual
  Pack o;
#pragma unroll
  for (int i = 0; i < V; ++i)
    o.v[i] = static_cast<T>(GLU ? acc[i] / (1.0f + expf(-acc[i])) * up[i] : acc[i]);
  *reinterpret_cast<Pack*>(out + (size_t)t * OUT + j) = o;
"""


# The residual's lines, in place of the marker where the kernel takes one (``r`` is no input otherwise).
_RESIDUAL = r"""  {
    const Pack rv = *reinterpret_cast<const Pack*>(r + (size_t)t * OUT + j);
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] += static_cast<float>(rv.v[i]);
  }"""


def source(dtype: mx.Dtype, width: int, out: int, h_offset: int, glu: bool = False, residual: bool = False) -> str:
    """The kernel's body for one group: its dtype, widths and form as constants."""
    return (f"  using T = {CUDA_TYPES[dtype]};\n  constexpr int W = {width}, OUT = {out}, HOFF = {h_offset};\n"
            f"  constexpr bool GLU = {'true' if glu else 'false'};\n"
            + _SOURCE.replace("  // residual", _RESIDUAL if residual else ""))


@lru_cache(maxsize=None)
def _kernel(dtype: mx.Dtype, width: int, out: int, h_offset: int, glu: bool, residual: bool):
    """One group's kernel (groups of one layer shape share it): built once, launched without template arguments."""
    form = "glu" if glu else "residual" if residual else "term"
    name = f"mlxd_lora_{form}_{CUDA_TYPES[dtype].strip('_')}_{width}_{out}_{h_offset}"
    return mx.fast.cuda_kernel(name=name, input_names=["y", "h", "b", "slots"] + ["r"] * residual,
                               output_names=["out"], source=source(dtype, width, out, h_offset, glu, residual))


def add_term(y: mx.array, h: mx.array, h_offset: int, b: mx.array, slots: mx.array, width: int, out: int,
             glu: bool = False, residual: mx.array | None = None) -> mx.array:
    """``[rows, out]``: ``y[:, :out]`` plus each row's own slot's term, ``h[:, h_offset + (s-1)*width :][:width]
    @ b[(s-1)*width :][:width, :out]`` for slot ``s`` (none for slot 0, the base). ``y`` and ``h`` are 2-D and
    row-contiguous (they may be one array), ``y`` and ``b`` whole arrays, not views (their rows are read
    ``VECTOR`` columns at a time: see ``fits``), ``slots`` uint32 ``[rows]``. With ``glu``, ``silu(g) * u`` of
    that sum ``g`` and of its next ``out`` columns' ``u`` (``y[:, out:2 * out]`` plus their term); with a
    ``residual`` ``[rows, out]`` (row-contiguous), that plus the sum."""
    rows, threads = y.shape[0], out // VECTOR
    inputs = [y, h, b, slots] + ([] if residual is None else [residual])
    return _kernel(y.dtype, width, out, h_offset, glu, residual is not None)(
        inputs=inputs, grid=(-(-threads // _THREADS) * _THREADS, rows, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, out)], output_dtypes=[y.dtype])[0]


def fits(*widths: int) -> bool:
    """Whether ``add_term`` takes arrays of these widths (``out``, ``y``'s and ``b``'s rows): whole ``VECTOR``-column
    packs."""
    return all(w % VECTOR == 0 for w in widths)
