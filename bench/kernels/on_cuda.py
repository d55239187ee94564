"""What the CUDA benchmarks of this folder start with."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx


def seeded_cuda(seed: int = 0) -> bool:
    """Whether MLX's CUDA back-end is here (saying so where it is not); seeds MLX's generator, printing the
    seed."""
    if not mx.cuda.is_available():
        print("needs MLX's CUDA back-end")
        return False
    mx.random.seed(seed)
    print(f"seed {seed}")
    return True


def alternating_ms(runs: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each of ``runs`` (name -> a function giving arrays, evaluated here), run in turn
    ``repeats`` times after one warm-up round, so that background load falls on all alike."""
    times = {name: [] for name in runs}
    for i in range(repeats + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            mx.eval(run())
            if i:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}
