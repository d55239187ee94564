"""What differs between MLX's backends, decided once per process.

On MLX's CPU backend the bundled reference BLAS runs a float32 matmul at a
few GFLOP/s; an optimized BLAS loaded with global symbols *before*
``mlx.core`` is imported takes its place (about 80x faster here). Quantized
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

fast_blas: str | None = None


def load_fast_blas() -> str | None:
    """Load an optimized BLAS with global symbols; returns its path, or None.

    Does nothing on macOS (MLX uses Accelerate/Metal there) or once
    ``mlx.core`` is already imported (too late to take effect).
    """
    global fast_blas
    # OpenBLAS's idle workers spin for 2^28 cycles after each call before they sleep. The
    # CPU path calls two OpenBLAS builds in turn (MLX's matmuls, numpy's in kernels/host.py),
    # and on a small machine one pool's spinning starved the other: prefill ran 2-3x slower.
    # 2^4 cycles: sleep almost at once. Read by each OpenBLAS when it loads (numpy's too, as
    # long as engined is imported before numpy).
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if fast_blas or sys.platform == "darwin" or "mlx.core" in sys.modules:
        return fast_blas
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
            fast_blas = path
            return path
    return None


def on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu or not (mx.metal.is_available() or mx.cuda.is_available())


def weight_dtype(requested: str = "auto"):
    """The dtype weights run in: float32 on CPU, None (keep the checkpoint's) on a GPU."""
    import mlx.core as mx

    if requested == "auto":
        return mx.float32 if on_cpu() else None
    if requested == "quantized":
        return None
    return getattr(mx, requested)
