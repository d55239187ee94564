"""``engined.kernels.gated_delta`` on a CUDA GPU: equal to mlx_lm's loop of operations, then how much faster.

    python3 -m bench.kernels.gated_delta_check

Correctness: random inputs, float32 and bf16, with and without a padding mask, scalar and per-key gates,
lengths 1, 4 and 37, against ``mlx_lm.models.gated_delta.gated_delta_ops`` on the same device. Timing:
the shape of Qwen3.5-8B's linear layers (16 key heads, 32 value heads, 128 x 128), bf16 inputs and a
float32 state, a decode row (T = 1), a verification window (T = 4) and a prompt chunk (T = 256), at
batch 1 and 16; median of 7 repetitions of 20 calls evaluated together.
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.gated_delta import gated_delta_ops

from mlxd.engined.kernels import gated_delta

SEED = 20261203


def inputs(rng, b, t, hk, hv, dk, dv, dtype, vec):
    def arr(*shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))
    q, k = arr(b, t, hk, dk, scale=dk ** -0.5), arr(b, t, hk, dk, scale=dk ** -0.5)
    g = mx.array(rng.uniform(0.8, 1.0, (b, t, hv, dk) if vec else (b, t, hv)).astype(np.float32))
    beta = mx.sigmoid(arr(b, t, hv)).astype(dtype)
    return q.astype(dtype), k.astype(dtype), arr(b, t, hv, dv).astype(dtype), g, beta, arr(b, hv, dv, dk) * 0.1


def check(rng) -> bool:
    ok = True
    for dtype, tol in ((mx.float32, 1e-4), (mx.bfloat16, 2e-2)):
        for b, t, hk, hv, dk, dv in ((1, 1, 2, 4, 128, 64), (3, 4, 2, 4, 64, 32), (2, 37, 16, 32, 128, 128)):
            for masked in (False, True):
                for vec in (False, True):
                    q, k, v, g, beta, state = inputs(rng, b, t, hk, hv, dk, dv, dtype, vec)
                    mask = mx.array(rng.random((b, t)) < 0.7) if masked else None
                    y, s = gated_delta.gated_delta(q, k, v, g, beta, state, mask)
                    ry, rs = gated_delta_ops(q, k, v, g, beta, state, mask)
                    if mask is not None:  # a padding token's output is unused (the loop's and Metal's differ)
                        keep = mask[..., None, None]
                        y, ry = mx.where(keep, y, 0), mx.where(keep, ry, 0)
                    ey = (mx.abs(y.astype(mx.float32) - ry.astype(mx.float32)).max()
                          / mx.maximum(mx.abs(ry.astype(mx.float32)).max(), 1e-6)).item()
                    es = (mx.abs(s - rs).max() / mx.maximum(mx.abs(rs).max(), 1e-6)).item()
                    good = ey <= tol and es <= tol
                    ok &= good
                    print(f"{'ok  ' if good else 'FAIL'} {str(dtype):14} b={b} t={t:<3} hk={hk} hv={hv} dk={dk} "
                          f"dv={dv} mask={masked!s:5} vec={vec!s:5} rel err y {ey:.2e} state {es:.2e}")
    return ok


def timed(fn, reps=7, calls=20) -> float:
    mx.eval(fn())
    times = []
    for _ in range(reps):
        outs = [fn() for _ in range(calls)]
        t0 = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def speed(rng) -> None:
    print("\n| batch | tokens | mlx_lm loop (us) | kernel (us) | ratio |\n|---|---|---|---|---|")
    for b in (1, 16):
        for t in (1, 4, 256):
            q, k, v, g, beta, state = inputs(rng, b, t, 16, 32, 128, 128, mx.bfloat16, False)
            loop = timed(lambda: gated_delta_ops(q, k, v, g, beta, state), reps=3 if t > 4 else 7,
                         calls=2 if t > 4 else 20)
            kern = timed(lambda: gated_delta.gated_delta(q, k, v, g, beta, state))
            print(f"| {b} | {t} | {loop * 1e6:.0f} | {kern * 1e6:.0f} | {loop / kern:.1f}x |")


def main() -> int:
    print(f"mlx {mx.__version__} {mx.default_device()}; seed {SEED}")
    rng = np.random.default_rng(SEED)
    ok = check(rng)
    print("all equal within tolerance" if ok else "MISMATCH")
    speed(rng)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
