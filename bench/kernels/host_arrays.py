"""What a step's arrays made on the host cost, one by one or packed into one.

MLX's CUDA allocator gives an array made from host data (``mx.array`` of a
NumPy array: a step's token ids, positions, slot mapping, LoRA slots) managed
memory; a decode step makes a dozen such arrays. This times a "step" of ``n``
small host arrays each read by one kernel, made three ways: each from NumPy,
all packed into one NumPy array and sliced on the device, and made on the
device, median milliseconds of ``--repeats`` alternations.

    python bench/kernels/host_arrays.py [--arrays 1 4 8 16] [--elements 64] [--repeats 50]

Needs MLX's CUDA back-end. Measured on the H200 (``bench/lora_results.md``, ninth session): packing saved
0.01-0.03 ms an array (8 arrays of 64 elements: 0.34 ms apart, 0.23 packed); no stall of the size of a
page fault per array showed.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mlx.core as mx  # noqa: E402

from bench.kernels.on_cuda import alternating_ms, seeded_cuda  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arrays", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--elements", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    if not seeded_cuda():
        return 1
    rng = np.random.default_rng(0)
    print("| arrays | each from NumPy (ms) | packed, one from NumPy (ms) | made on the device (ms) |")
    print("|---|---|---|---|")
    for n in args.arrays:
        e = args.elements

        def apart():
            return [mx.array(rng.integers(0, 1000, e, dtype=np.int32)) + 1 for _ in range(n)]

        def packed():
            one = mx.array(rng.integers(0, 1000, n * e, dtype=np.int32))
            return [one[i * e:(i + 1) * e] + 1 for i in range(n)]

        def on_device():
            return [mx.random.randint(0, 1000, (e,), dtype=mx.int32) + 1 for _ in range(n)]

        med = alternating_ms({"apart": apart, "packed": packed, "device": on_device}, args.repeats)
        print(f"| {n} | {med['apart']:.3f} | {med['packed']:.3f} | {med['device']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
