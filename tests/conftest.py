"""Shared fixtures, and the test session's start-up."""

import os
from pathlib import Path

from mlxd.engined.device import load_fast_blas


def pytest_configure(config):
    # The tests run MLX on the CPU in this process: load the optimized BLAS before any test
    # module imports mlx.core, as the engine process does when it starts (engined/device.py).
    load_fast_blas()
    # The processes the tests spawn (servers, CLIs) run as a user's install does, without torch
    # (tests/without_torch/sitecustomize.py): every one of them would otherwise import it.
    paths = [str(Path(__file__).parent / "without_torch"), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
