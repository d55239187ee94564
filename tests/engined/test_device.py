"""The CPU's BLAS: loaded before MLX, or a start-up warning that says how slow and how to fix it."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "darwin", reason="MLX uses Accelerate on macOS")


def _in_a_fresh_process(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_blas_loaded_before_mlx_gives_no_warning():
    out = _in_a_fresh_process(
        "from engined.device import load_fast_blas, slow_blas_warning\n"
        "assert load_fast_blas() is not None\n"
        "print(slow_blas_warning())")
    assert out == "None"


def test_mlx_on_the_reference_blas_is_said_with_the_fix():
    # MLX imported first: its reference BLAS is bound and a BLAS loaded later is too late, as on a
    # host without OpenBLAS.
    out = _in_a_fresh_process(
        "import mlx.core\n"
        "from engined.device import BLAS_FIX, load_fast_blas, slow_blas_warning\n"
        "assert load_fast_blas() is None\n"
        "print(slow_blas_warning())")
    assert "no optimized BLAS found" in out and "80x slower" in out
    assert "sudo apt-get install libopenblas0-pthread libgfortran5" in out
