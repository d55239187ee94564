"""What one operation costs the host in a decode step on CUDA, by kind: where a step's time goes when it is bound
by the host (``bench/lora_results.md``, ``bench/host_step_results.md``).

A chain of ``--ops`` operations, each on the previous one's output (``[rows, 4096]`` bf16), built and evaluated
as a step is; per kind the median microseconds per operation over ``--repeats`` chains, alternating kinds:

- ``add``: MLX's own binary kernel (``y + c``);
- ``tiny kernel``: ``mx.fast.cuda_kernel`` of a one-line source and no template argument;
- ``tiny kernel, 7 template ints``: the same with as many template arguments as the LoRA term has;
- ``tiny kernel, long source``: the one line behind 1.5 KB of comment (the LoRA term's source size);
- ``lora term``: ``engined.kernels.lora_term.add_term`` as a q/k/v group calls it (4 slots of rank 16);
- ``matmul``: ``y @ w`` with ``w [4096, 4096]`` (cuBLASLt past one row, MLX's GEMV at one);
- ``graph only``: building the ``lora term`` chain without evaluating it (the Python part).

    python bench/kernels/launch_cost.py [--rows 1 8] [--ops 128] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import lru_cache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mlx.core as mx  # noqa: E402

from bench.kernels.on_cuda import seeded_cuda  # noqa: E402

from engined.kernels import lora_term  # noqa: E402

WIDTH = 4096
_TINY = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < ROWS * 4096) out[i] = y[i];
"""


@lru_cache(maxsize=None)
def tiny(long: bool):
    source = ("/*" + "x" * 1500 + "*/\n" if long else "") + _TINY
    return mx.fast.cuda_kernel(name=f"bench_tiny_{int(long)}", input_names=["y"], output_names=["out"],
                               source=source)


def call_tiny(y: mx.array, long: bool = False, extra: bool = False) -> mx.array:
    template = [("ROWS", y.shape[0])] + ([(f"P{i}", i) for i in range(6)] if extra else [])
    return tiny(long)(inputs=[y], template=template, grid=(y.size, 1, 1), threadgroup=(256, 1, 1),
                      output_shapes=[y.shape], output_dtypes=[y.dtype])[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ops", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if not seeded_cuda():
        return 1
    w = (mx.random.normal((WIDTH, WIDTH)) * 0.01).astype(mx.bfloat16)
    width, slots = 48, 4  # a q/k/v group's slot width at rank 16, 4 slots
    b = (mx.random.normal((slots * width, WIDTH + slots * width)) * 0.01).astype(mx.bfloat16)
    mx.eval(w, b)
    print("| rows | " + " | ".join(["add", "tiny kernel", "tiny kernel, 7 template ints", "tiny kernel, long source",
                                     "lora term", "matmul", "graph only (lora term)"]) + " |  (us per operation)")
    print("|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        y0 = mx.random.normal((rows, WIDTH + slots * width)).astype(mx.bfloat16)
        c = mx.random.normal((rows, WIDTH)).astype(mx.bfloat16)
        s = mx.array([t % (slots + 1) for t in range(rows)], dtype=mx.uint32)
        mx.eval(y0, c, s)

        def chain(op):
            y = y0[:, :WIDTH] + 0
            for _ in range(args.ops):
                y = op(y)
            return y

        def term(y):  # y plus each row's term from the x·A columns past y0's first WIDTH
            return lora_term.add_term(y, y0, WIDTH, b, s, width, WIDTH)

        kinds = {
            "add": lambda: chain(lambda y: y + c),
            "tiny": lambda: chain(call_tiny),
            "tiny7": lambda: chain(lambda y: call_tiny(y, extra=True)),
            "tinylong": lambda: chain(lambda y: call_tiny(y, long=True)),
            "term": lambda: chain(term),
            "matmul": lambda: chain(lambda y: y @ w),
        }
        times = {k: [] for k in list(kinds) + ["graph"]}
        for i in range(args.repeats + 1):
            for k, build in kinds.items():
                start = time.perf_counter()
                mx.eval(build())
                if i:
                    times[k].append((time.perf_counter() - start) * 1e6 / args.ops)
            start = time.perf_counter()
            out = kinds["term"]()
            if i:
                times["graph"].append((time.perf_counter() - start) * 1e6 / args.ops)
            mx.eval(out)
        cells = [f"{statistics.median(times[k]):.1f}" for k in list(kinds) + ["graph"]]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
