"""What a prefill chunk of a shape not seen before costs in MLX's fused SDPA on CUDA.

MLX's CUDA SDPA builds a cuDNN graph for every new combination of q/k/v shapes
and strides (an LRU of 256) on the host, inside the evaluation that meets it.
Paged prefill chunks come in every (query length, context length), so a serving
engine meets new shapes all the time. For chunks of Llama-8B's heads (32 query,
8 KV, D = 128) at random lengths this prints each shape's first call and its
second (the build's cost), in four forms: bottom-right causal (the engine's
route); the query and its context padded at the end by the same rows, so that
the query rows are a multiple of ``--bucket`` (still causal and exact: a real
row never reaches a padded key; a fresh prompt's chunk, context = query, then
has one shape per bucket); an additive bias mask of the same causal pattern;
and both lengths padded to multiples of ``--bucket`` under a bias mask (the
form whose shapes a warm-up could build ahead whatever the context).

    python -m bench.kernels.sdpa_shapes [--shapes 8] [--bucket 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from mlxd.bench.kernels.on_cuda import seeded_cuda

H, HKV, D = 32, 8, 128


def _timed(fn) -> float:
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - start) * 1e3


def causal_bias(ql: int, sl: int, rows: int, cols: int) -> mx.array:
    """``[1, 1, rows, cols]`` bf16: 0 where query ``i`` (of the last ``ql`` positions of ``sl``) may see key ``j``,
    -inf elsewhere and on padding."""
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    ok = (j <= i + (sl - ql)) & (i < ql) & (j < sl)
    ok[ql:, 0] = True  # padded rows see one key, so that softmax stays finite
    return mx.array(np.where(ok, 0.0, -np.inf).astype(np.float32)).astype(mx.bfloat16)[None, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not seeded_cuda(args.seed):
        return
    rng = np.random.default_rng(args.seed)
    scale = D ** -0.5
    rows = {"causal": [], "equal padding, causal": [], "bias mask": [], "padded, bias mask": []}
    print(f"| query / context | causal: first, second ms | query padded to {args.bucket}s, context alike, causal "
          f"| bias mask | padded to {args.bucket}s, bias mask |\n|---|---|---|---|---|")
    for _ in range(args.shapes):
        ql = int(rng.integers(64, 2048))
        sl = ql + int(rng.integers(0, 2048))
        q = mx.random.normal((1, H, ql, D)).astype(mx.bfloat16)
        k = mx.random.normal((1, HKV, sl, D)).astype(mx.bfloat16)
        v = mx.random.normal((1, HKV, sl, D)).astype(mx.bfloat16)
        b = args.bucket
        qp, sp = -(-ql // b) * b, -(-sl // b) * b
        qpad = mx.pad(q, [(0, 0), (0, 0), (0, qp - ql), (0, 0)])
        kpad = mx.pad(k, [(0, 0), (0, 0), (0, sp - sl), (0, 0)])
        vpad = mx.pad(v, [(0, 0), (0, 0), (0, sp - sl), (0, 0)])
        mask, mask_pad = causal_bias(ql, sl, ql, sl), causal_bias(ql, sl, qp, sp)
        kalike = mx.pad(k, [(0, 0), (0, 0), (0, qp - ql), (0, 0)])
        valike = mx.pad(v, [(0, 0), (0, 0), (0, qp - ql), (0, 0)])
        mx.eval(q, k, v, qpad, kpad, vpad, kalike, valike, mask, mask_pad)
        forms = {
            "causal": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"),
            "equal padding, causal": lambda: mx.fast.scaled_dot_product_attention(
                qpad, kalike, valike, scale=scale, mask="causal")[:, :, :ql],
            "bias mask": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
            "padded, bias mask": lambda: mx.fast.scaled_dot_product_attention(qpad, kpad, vpad, scale=scale,
                                                                              mask=mask_pad)[:, :, :ql],
        }
        ref = forms["causal"]()
        cells = []
        for name, fn in forms.items():
            first, second = _timed(fn), _timed(fn)
            rows[name].append((first, second))
            err = mx.abs(fn().astype(mx.float32) - ref.astype(mx.float32)).max().item()
            cells.append(f"{first:.1f}, {second:.2f}" + (f" (max err {err:.1e})" if name != "causal" else ""))
        print(f"| {ql} / {sl} | " + " | ".join(cells) + " |", flush=True)
    for name, r in rows.items():
        print(f"{name}: median first call {statistics.median(f for f, _ in r):.1f} ms, "
              f"second {statistics.median(s for _, s in r):.2f} ms")


if __name__ == "__main__":
    main()
