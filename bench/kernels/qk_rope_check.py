"""``engined.kernels.qk_rope`` on a CUDA GPU: its q/k/v against MLX's operations, and what each costs the host.

For each dtype and layer shape (Qwen3-8B's heads with per-head norms, SmolLM2-135M's
without) and token count: random projection rows and positions, the kernel's
``q, k, v`` against the split, reshapes, ``mx.fast.rms_norm``, ``mx.fast.rope`` and
squeezes ``PagedAttention`` runs otherwise; the largest error relative to the largest
output. Then, for one decode step's worth of layers (``--layers`` calls at c rows):
Python's graph building and ``mx.async_eval``'s encoding per layer, both ways.

    python -m bench.kernels.qk_rope_check [--layers 36]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx.nn as nn

from mlxd.engined.kernels.qk_rope import QKRope

SHAPES = {"qwen3-8b": (32, 8, 128, True, 1e6), "smollm2-135m": (9, 3, 64, False, 1e5)}


def _parts(heads, kv_heads, d, norm, base, dtype):
    rope = nn.RoPE(d, base=base)
    q_norm = k_norm = None
    if norm:
        q_norm, k_norm = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        q_norm.weight = (1 + 0.2 * mx.random.normal((d,))).astype(dtype)
        k_norm.weight = (1 + 0.2 * mx.random.normal((d,))).astype(dtype)
    return rope, q_norm, k_norm


def mlx_ops(qkv, positions, heads, kv_heads, d, rope, q_norm, k_norm):
    """What ``PagedAttention`` builds without the kernel."""
    t = qkv.shape[0]
    q, k, v = mx.split(qkv, [heads * d, (heads + kv_heads) * d], axis=-1)
    q, k = q.reshape(t, heads, 1, d), k.reshape(t, kv_heads, 1, d)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return rope(q, offset=positions).squeeze(2), rope(k, offset=positions).squeeze(2), v.reshape(t, kv_heads, d)


def check() -> bool:
    ok = True
    print("| shape | dtype | T | q err | k err | v err |\n|---|---|---|---|---|---|")
    for name, (heads, kv_heads, d, norm, base) in SHAPES.items():
        for dtype, tol in ((mx.bfloat16, 1.6e-2), (mx.float16, 2e-3), (mx.float32, 2e-5)):
            rope, q_norm, k_norm = _parts(heads, kv_heads, d, norm, base, dtype)
            fused = QKRope(heads, kv_heads, d, rope, q_norm, k_norm)
            for t in (1, 64, 517):
                qkv = (3 * mx.random.normal((t, (heads + 2 * kv_heads) * d))).astype(dtype)
                positions = mx.random.randint(0, 32768, (t,)).astype(mx.int32)
                want = mlx_ops(qkv, positions, heads, kv_heads, d, rope, q_norm, k_norm)
                got = fused(qkv, positions)
                errs = [(mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max()
                         / mx.abs(w.astype(mx.float32)).max()).item() for g, w in zip(got, want)]
                shapes_ok = all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want))
                ok &= shapes_ok and max(errs) <= tol
                print(f"| {name} | {dtype} | {t} | {errs[0]:.2e} | {errs[1]:.2e} | {errs[2]:.2e} |"
                      + ("" if shapes_ok else " shapes differ"), flush=True)
    return ok


def host_cost(layers: int, rows: int) -> None:
    heads, kv_heads, d, norm, base = SHAPES["qwen3-8b"]
    rope, q_norm, k_norm = _parts(heads, kv_heads, d, norm, base, mx.bfloat16)
    fused = QKRope(heads, kv_heads, d, rope, q_norm, k_norm)
    qkvs = [mx.random.normal((rows, (heads + 2 * kv_heads) * d)).astype(mx.bfloat16) for _ in range(layers)]
    positions = mx.arange(rows, dtype=mx.int32) + 700
    mx.eval(qkvs, positions)
    ways = {"mlx ops": lambda x: mlx_ops(x, positions, heads, kv_heads, d, rope, q_norm, k_norm),
            "kernel": lambda x: fused(x, positions)}
    print(f"\nper layer, {layers} layers of {rows} rows, best of 5 (us):\n| way | build | async_eval |\n|---|---|---|")
    for way, fn in ways.items():
        best = None
        for _ in range(6):
            t0 = time.perf_counter()
            outs = [fn(x) for x in qkvs]
            t1 = time.perf_counter()
            mx.async_eval(outs)
            t2 = time.perf_counter()
            mx.eval(outs)
            got = (t1 - t0, t2 - t1)
            best = got if best is None or sum(got) < sum(best) else best
        print(f"| {way} | {1e6 * best[0] / layers:.1f} | {1e6 * best[1] / layers:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    mx.random.seed(0)
    ok = check()
    host_cost(args.layers, args.rows)
    print("\nall within tolerance" if ok else "\nOUT OF TOLERANCE")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
