"""What a LoRA group's folded A columns cost the base matmul, and whether a rounder width wins it back.

A folded group (``engined/lora/groups.py``) appends every slot's A columns to
its base weight as extra output rows, so its one matmul gives ``[y | x·A]``:
Llama-8B's q/k/v join grows from 6 144 outputs to 6 336 at 4 adapters of rank
16, o_proj and down_proj from 4 096 to 4 160. Every row pays that, with or
without an adapter. This times one step's matmuls (each of 32 layers its own
weights, one evaluation), at a decode step's few rows and a prefill chunk's,
for each width: the base's, the folded one, and the folded one rounded up to
a multiple of 128 and of 256 (zero rows).

    python bench/kernels/fold_width.py [--rows 8 64 2048] [--repeats 10]

Needs MLX's CUDA back-end.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mlx.core as mx  # noqa: E402

from bench.kernels.on_cuda import alternating_ms, seeded_cuda  # noqa: E402

# Llama-8B's groups of one layer: (outputs, inputs, A columns at 4 adapters of rank 16).
GROUPS = [(6144, 4096, 192), (4096, 4096, 64), (28672, 4096, 128), (4096, 14336, 64)]
LAYERS = 32


def widths(out: int, columns: int) -> dict[str, int]:
    folded = out + columns
    return {"base": out, "folded": folded, "folded, 128": -(-folded // 128) * 128,
            "folded, 256": -(-folded // 256) * 256}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 2048])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if not seeded_cuda():
        return 1
    forms = list(widths(1, 1))
    weights = {form: [] for form in forms}
    for form in forms:
        for _ in range(LAYERS):
            weights[form].append([(mx.random.normal((widths(n, c)[form], k)) * 0.02).astype(mx.bfloat16)
                                  for n, k, c in GROUPS])
            mx.eval(weights[form][-1])
    print("widths: " + "; ".join(f"{form} " + " ".join(str(widths(n, c)[form]) for n, _, c in GROUPS)
                                 for form in forms))
    print("| rows | " + " | ".join(f"{form} (ms)" for form in forms) + " | " +
          " | ".join(f"{form} / base" for form in forms[1:]) + " |")
    print("|---" * (2 * len(forms)) + "|")
    for rows in args.rows:
        xs = {k: mx.random.normal((rows, k)).astype(mx.bfloat16) for _, k, _ in GROUPS}
        mx.eval(xs)
        med = alternating_ms({form: (lambda f=form: [xs[w.shape[1]] @ w.T for layer in weights[f] for w in layer])
                              for form in forms}, args.repeats)
        print(f"| {rows} | " + " | ".join(f"{med[f]:.2f}" for f in forms) + " | " +
              " | ".join(f"{med[f] / med['base']:.2f}x" for f in forms[1:]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
