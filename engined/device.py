"""What differs between MLX's devices: the BLAS the CPU backend runs on, and the weights' dtype.

On MLX's CPU backend the bundled reference BLAS runs a float32 matmul at a
few GFLOP/s; an optimized BLAS loaded with global symbols *before*
``mlx.core`` is imported takes its place (about 80x faster here), so the
engine process calls ``load_fast_blas`` first thing when it starts (never at
import: importing a module must not change the process). Quantized
matmul on CPU does not use BLAS at all, so weights are dequantized to float32
there. On Metal and CUDA the checkpoint's quantized weights are kept.
"""

from __future__ import annotations

import ctypes
import os
import sys

# Debian/Ubuntu multiarch paths of OpenBLAS (pthread build) and the Fortran
# runtime it needs loaded first.
_BLAS_CANDIDATES = (
    ("libgfortran.so.5", "openblas-pthread/libopenblas.so.0"),
    ("libgfortran.so.5", "libopenblas.so.0"),
)
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")

_loaded: list[str] = []


def load_fast_blas() -> str | None:
    """Load an optimized BLAS with global symbols; returns its path, or None.

    Call it at the start of a process that runs MLX on the CPU (the engine,
    the test session, a benchmark), before anything imports ``mlx.core``.
    Does nothing on macOS (MLX uses Accelerate/Metal there) or once
    ``mlx.core`` is already imported (too late to take effect).
    """
    # OpenBLAS's idle workers spin for 2^28 cycles after each call before they sleep. The
    # CPU path calls two OpenBLAS builds in turn (MLX's matmuls, numpy's in kernels/host.py),
    # and on a small machine one pool's spinning starved the other: prefill ran 2-3x slower.
    # 2^4 cycles: sleep almost at once. OpenBLAS reads it only from the environment, when it
    # loads (numpy's too, as long as this runs before numpy is imported).
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if _loaded or sys.platform == "darwin" or "mlx.core" in sys.modules:
        return _loaded[0] if _loaded else None
    for libdir in _LIB_DIRS:
        for runtime, blas in _BLAS_CANDIDATES:
            path = os.path.join(libdir, blas)
            if not os.path.exists(path):
                continue
            try:
                ctypes.CDLL(os.path.join(libdir, runtime), mode=ctypes.RTLD_GLOBAL)
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _loaded.append(path)
            return path
    return None


# What installs the BLAS ``load_fast_blas`` looks for, on Debian and Ubuntu.
BLAS_FIX = "sudo apt-get install libopenblas0-pthread libgfortran5"


def slow_blas_warning() -> str | None:
    """One line for the start-up log when MLX runs on a Linux CPU without an optimized BLAS, else None.

    Call it after ``load_fast_blas``: without the BLAS every matmul runs about 80x slower, so the
    warm-up alone takes minutes, and a user otherwise sees only a start-up that does not end.
    """
    if _loaded or sys.platform == "darwin" or not on_cpu():
        return None
    return ("no optimized BLAS found: MLX's CPU backend runs its reference BLAS, about 80x slower "
            f"(start-up takes minutes, so do prompts); install OpenBLAS and start again: {BLAS_FIX}")


def on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu or not (mx.metal.is_available() or mx.cuda.is_available())


def device_kind() -> str:
    """Where MLX runs the model: "cpu", "metal" or "cuda" (the keys of ``shared.config.DEVICE_DEFAULTS``)."""
    import mlx.core as mx

    return "cpu" if on_cpu() else "metal" if mx.metal.is_available() else "cuda"


def weight_dtype(requested: str = "auto"):
    """The dtype weights run in: float32 on CPU, None (keep the checkpoint's) on a GPU."""
    import mlx.core as mx

    if requested == "auto":
        return mx.float32 if on_cpu() else None
    if requested == "quantized":
        return None
    return getattr(mx, requested)
