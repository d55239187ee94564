"""What the CUDA benchmarks of this folder start with."""

from __future__ import annotations

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
