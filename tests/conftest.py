"""Shared fixtures, and the test session's start-up."""

from mlxd.engined.device import load_fast_blas


def pytest_configure(config):
    # The tests run MLX on the CPU in this process: load the optimized BLAS before any test
    # module imports mlx.core, as the engine process does when it starts (engined/device.py).
    load_fast_blas()
