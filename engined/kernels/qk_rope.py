"""An attention layer's queries, keys and values from its joined projection, in one CUDA kernel.

Through MLX, the joined q/k/v projection's output becomes the attention's
inputs in ten graph nodes a layer: the split, the reshapes into heads, the
per-head RMS norms of queries and keys (where the family has them), RoPE on
each and the squeezes after it. A decode step on a GPU is bound by the
host's cost per node (~2.5 us of Python and of MLX's encoding each,
``bench/gpu_op_costs.py``), so here one launch reads the projection's rows
and writes ``q [T, H, D]``, ``k`` and ``v [T, HKV, D]``.

One warp per (token, head): a lane holds ``D / 64`` pairs of rotated
elements ``(i, i + D/2)`` (RoPE's non-interleaved form), the norm's sum of
squares is a warp reduction, values are copied. The norm's output is rounded
to the model's dtype before RoPE, as between MLX's two operations.

Covers what mlx_lm builds as ``nn.RoPE`` over the whole head (no
interleaving) with per-head ``nn.RMSNorm`` on both queries and keys, or on
neither; other forms keep MLX's operations (``PagedAttention``).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.engined.kernels.source import CUDA_TYPES

_THREADS = 128  # four warps a group, each a (token, head)

# ``T``, ``H``, ``HKV``, ``D``, RoPE's base and scale and the norm's ``EPS`` (or its absence) are written into each layer shape's own copy of the source
# (``source``): MLX formats template arguments into a kernel's text and name at every call.
_SOURCE = r"""
  constexpr int HEADS = H + 2 * HKV, NP = D / 64, HALF = D / 2;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int t = warp / HEADS, hh = warp % HEADS;
  if (t >= pos_shape[0]) return;
  const T* src = qkv + (size_t)t * HEADS * D + (size_t)hh * D;
  if (hh >= H + HKV) {
    T* dst = v + ((size_t)t * HKV + (hh - H - HKV)) * D;
    for (int i = lane; i < D; i += 32) dst[i] = src[i];
    return;
  }
  float a[NP], b[NP];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    a[j] = static_cast<float>(src[lane + 32 * j]);
    b[j] = static_cast<float>(src[lane + 32 * j + HALF]);
  }
  const bool is_q = hh < H;
  // norm
  // The angle as MLX's RoPE computes it, so that the two agree to the last bit in float32.
  const float p = SCALE * static_cast<float>(pos[t]);
  T* dst = is_q ? q + ((size_t)t * H + hh) * D : k + ((size_t)t * HKV + (hh - H)) * D;
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    const int i = lane + 32 * j;
    const float theta = p * exp2f(-(static_cast<float>(i) / static_cast<float>(HALF)) * LOG2_BASE);
    const float c = cosf(theta), s = sinf(theta);
    dst[i] = static_cast<T>(a[j] * c - b[j] * s);
    dst[i + HALF] = static_cast<T>(a[j] * s + b[j] * c);
  }
"""


# The norm's lines, in place of the marker where the layer has one (``qw`` and ``kw`` are no inputs otherwise).
_NORM = r"""  {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NP; ++j) ss += a[j] * a[j] + b[j] * b[j];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = rsqrtf(ss / D + EPS);
    const T* w = is_q ? qw : kw;
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const int i = lane + 32 * j;
      a[j] = static_cast<float>(static_cast<T>(a[j] * inv * static_cast<float>(w[i])));
      b[j] = static_cast<float>(static_cast<T>(b[j] * inv * static_cast<float>(w[i + HALF])));
    }
  }"""


def source(dtype: mx.Dtype, heads: int, kv_heads: int, head_dim: int, base: float, scale: float,
           eps: float | None) -> str:
    """The kernel's body for one layer shape: its dtype, head counts, RoPE and norm as constants (``eps`` None:
    no norm)."""
    log2_base = float(np.log2(np.float32(base)))  # in float32, as MLX passes it
    return (f"  using T = {CUDA_TYPES[dtype]};\n  constexpr int H = {heads}, HKV = {kv_heads}, D = {head_dim};\n"
            f"  constexpr float LOG2_BASE = {log2_base!r}f, SCALE = {float(scale)!r}f;\n"
            + (f"  constexpr float EPS = {eps!r}f;\n" if eps is not None else "")
            + _SOURCE.replace("  // norm", _NORM if eps is not None else ""))


@lru_cache(maxsize=None)
def _kernel(dtype: mx.Dtype, heads: int, kv_heads: int, head_dim: int, base: float, scale: float, eps: float | None):
    """One layer shape's kernel (the layers of a model share it): built once, launched without template arguments."""
    name = f"mlxd_qk_rope_{CUDA_TYPES[dtype].strip('_')}_{heads}_{kv_heads}_{head_dim}" + ("_norm" * (eps is not None))
    inputs = ["qkv", "pos"] + (["qw", "kw"] if eps is not None else [])
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=["q", "k", "v"],
                               source=source(dtype, heads, kv_heads, head_dim, base, scale, eps))


class QKRope:
    """``qkv [T, (H + 2 HKV) D]`` and positions ``[T]`` to ``q [T, H, D]``, ``k, v [T, HKV, D]`` in one launch."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, rope: nn.RoPE,
                 q_norm: nn.RMSNorm | None, k_norm: nn.RMSNorm | None):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.base, self.scale = float(rope.base), float(rope.scale)
        self.eps = None if q_norm is None else float(q_norm.eps)
        # The norms' modules, not their arrays: read at each call, so weights loaded later are the ones used.
        self.q_norm, self.k_norm = q_norm, k_norm

    def __call__(self, qkv: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        t, h, hkv, d = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        inputs = [qkv, positions]
        if self.eps is not None:
            inputs += [self.q_norm.weight, self.k_norm.weight]
        warps = t * (h + 2 * hkv)
        return tuple(_kernel(qkv.dtype, h, hkv, d, self.base, self.scale, self.eps)(
            inputs=inputs, grid=(-(-warps * 32 // _THREADS) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
            output_shapes=[(t, h, d), (t, hkv, d), (t, hkv, d)], output_dtypes=[qkv.dtype] * 3))

    @staticmethod
    def takes(rope: nn.Module | None, q_norm: nn.Module | None, k_norm: nn.Module | None, head_dim: int) -> bool:
        """Whether a layer of these parts is the form the kernel computes: ``nn.RoPE`` over whole heads, not
        interleaved, and per-head ``nn.RMSNorm`` of one epsilon on both queries and keys, or on neither."""
        if type(rope) is not nn.RoPE or rope.traditional or rope.dims != head_dim or head_dim % 64:
            return False
        if q_norm is None and k_norm is None:
            return True
        return (type(q_norm) is nn.RMSNorm and type(k_norm) is nn.RMSNorm and q_norm.eps == k_norm.eps
                and q_norm.weight.shape == k_norm.weight.shape == (head_dim,))
