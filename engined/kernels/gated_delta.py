"""The gated delta rule (the recurrence of Qwen3.5 / Qwen3-Next linear layers) as one CUDA kernel.

mlx_lm runs this recurrence as one Metal kernel per layer on a Mac and, on any
other device, as a Python loop of MLX operations per token
(``gated_delta_ops``). On MLX's CUDA backend that loop makes a 4-token
verification window four rounds of every linear layer's operations and a
prompt one round per token, so an NVIDIA GPU standing in for a Mac would
measure the loop rather than the model. This kernel does on CUDA what mlx_lm's
Metal kernel does on a Mac: one warp per (sequence, value head, value row)
keeps its row of the state in registers (``Dk / 32`` floats a lane) and walks
the tokens in order, two warp sums a token.

``update`` has the signature of mlx_lm's ``gated_delta_update``;
``engined.linear_attention`` runs it in place of mlx_lm's when the attention
backend is ``cuda``. Shapes it does not cover go to mlx_lm's loop.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g, gated_delta_ops

_HEADER = r"""
__device__ inline float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
"""

# Grid: x one warp (32 lanes over Dk), y the value rows (4 per block), z sequence x value head.
_SOURCE = r"""
  constexpr int NP = Dk / 32;
  const int n = blockIdx.z;
  const int b = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int lane = threadIdx.x;
  const int dv = blockIdx.y * blockDim.y + threadIdx.y;
  const int T = iparams[0];

  const InT* q_ = q + (size_t)b * T * Hk * Dk + hk * Dk + lane * NP;
  const InT* k_ = k + (size_t)b * T * Hk * Dk + hk * Dk + lane * NP;
  const InT* v_ = v + (size_t)b * T * Hv * Dv + hv * Dv + dv;
  InT* y_ = y + (size_t)b * T * Hv * Dv + hv * Dv + dv;
  const GT* g_ = g + (size_t)b * T * Hv * (VEC ? Dk : 1) + hv * (VEC ? Dk : 1) + (VEC ? lane * NP : 0);
  const BT* beta_ = beta + (size_t)b * T * Hv + hv;
  const StT* s_in = state_in + ((size_t)n * Dv + dv) * Dk + lane * NP;
  StT* s_out = state_out + ((size_t)n * Dv + dv) * Dk + lane * NP;

  float s[NP];
#pragma unroll
  for (int i = 0; i < NP; ++i) s[i] = static_cast<float>(s_in[i]);

  for (int t = 0; t < T; ++t) {
    if (!MASK || mask[b * T + t]) {
      float kv = 0.0f;
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        s[i] *= static_cast<float>(g_[VEC ? i : 0]);
        kv += s[i] * static_cast<float>(k_[i]);
      }
      kv = warp_sum(kv);
      const float delta = (static_cast<float>(v_[0]) - kv) * static_cast<float>(beta_[0]);
      float o = 0.0f;
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        s[i] += static_cast<float>(k_[i]) * delta;
        o += s[i] * static_cast<float>(q_[i]);
      }
      o = warp_sum(o);
      if (lane == 0) y_[0] = static_cast<InT>(o);
    } else if (lane == 0) {
      y_[0] = static_cast<InT>(0.0f);
    }
    q_ += Hk * Dk;
    k_ += Hk * Dk;
    v_ += Hv * Dv;
    y_ += Hv * Dv;
    g_ += Hv * (VEC ? Dk : 1);
    beta_ += Hv;
  }
#pragma unroll
  for (int i = 0; i < NP; ++i) s_out[i] = static_cast<StT>(s[i]);
"""

_ROWS_PER_BLOCK = 4


@lru_cache(maxsize=256)
def _length(t: int) -> mx.array:
    # A layer's every call in a step passes the same length: one small array each, not one per call.
    return mx.array([t], dtype=mx.int32)


@lru_cache(maxsize=1)
def _no_mask() -> mx.array:
    return mx.array([True])


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(
        name="mlxd_gated_delta", input_names=["q", "k", "v", "g", "beta", "state_in", "iparams", "mask"],
        output_names=["y", "state_out"], source=_SOURCE, header=_HEADER)


def covers(k: mx.array, v: mx.array) -> bool:
    """Whether the kernel takes these key and value shapes ([B, T, H, D])."""
    return k.shape[-1] % 32 == 0 and v.shape[-1] % _ROWS_PER_BLOCK == 0 and v.shape[-2] % k.shape[-2] == 0


def gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """mlx_lm's ``gated_delta_kernel`` contract: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g [B, T, Hv]
    (or [B, T, Hv, Dk]); beta [B, T, Hv]; state [B, Hv, Dv, Dk]; mask [B, T] or None (a masked token
    leaves the state as it was and outputs zeros). Returns (y [B, T, Hv, Dv], the state after)."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    return _kernel()(
        inputs=[q, k, v, g, beta, state, _length(t), mask if mask is not None else _no_mask()],
        template=[("InT", q.dtype), ("GT", g.dtype), ("BT", beta.dtype), ("StT", state.dtype), ("Dk", dk),
                  ("Dv", dv), ("Hk", hk), ("Hv", hv), ("MASK", mask is not None), ("VEC", g.ndim == 4)],
        grid=(32, dv, b * hv), threadgroup=(32, _ROWS_PER_BLOCK, 1),
        output_shapes=[(b, t, hv, dv), state.shape], output_dtypes=[q.dtype, state.dtype])


def update(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array,
           state: mx.array | None = None, mask: mx.array | None = None, *, use_kernel: bool = True,
           lower_bound: float | None = None, allow_neg_eigval: bool = False) -> tuple[mx.array, mx.array]:
    """mlx_lm's ``gated_delta_update`` (same arguments, same gates), with the recurrence in this kernel."""
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    g = compute_g(A_log, a, dt_bias) if lower_bound is None else compute_lower_bound_g(A_log, a, dt_bias,
                                                                                        lower_bound)
    if state is None:
        state = mx.zeros((q.shape[0], v.shape[-2], v.shape[-1], q.shape[-1]), dtype=mx.float32)
    if not use_kernel or not covers(k, v):
        return gated_delta_ops(q, k, v, g, beta, state, mask)
    return gated_delta(q, k, v, g, beta, state, mask)


def recurrence(backend: str):
    """The gated-delta update linear layers run for this attention backend (``engined.kernels.resolve_backend``'s
    answer), or None for mlx_lm's own: its Metal kernel on a Mac, its loop on the CPU."""
    return update if backend == "cuda" else None
