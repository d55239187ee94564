"""Paged variable-length attention: one contract, several implementations.

``paged_attention`` runs the Metal kernel on a Metal GPU, the CUDA kernel on a
CUDA GPU, the numpy host path on the CPU (float32), and the pure-MLX reference
otherwise (a shape or dtype the others do not cover). ``MLXD_ATTENTION=reference``
forces the reference; it is read here, once, at import.
"""

from __future__ import annotations

import os

import mlx.core as mx

from kernels import gpu, host, reference
from kernels.metadata import AttentionMetadata
from kernels.reference import write_kv

__all__ = ["AttentionMetadata", "backend", "paged_attention", "write_kv"]

_FORCE_REFERENCE = os.environ.get("MLXD_ATTENTION", "").strip().lower() == "reference"


def backend() -> str:
    """Which implementation ``paged_attention`` uses on the current default device."""
    if _FORCE_REFERENCE:
        return "reference"
    if mx.default_device().type != mx.DeviceType.gpu:
        return "host"
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "reference"


def paged_attention(
    q: mx.array,
    k_cache: mx.array,
    v_cache: mx.array,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of packed queries ``q [T, H, D]`` over each request's paged context.

    Same contract as ``reference.paged_attention`` (see there); returns ``[T, H, D]``
    in ``q``'s dtype. The GPU kernels do not take ``sinks`` yet: with sinks the
    reference runs.
    """
    which = backend()
    if which == "host" and host.supported(q, k_cache):
        return host.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
    if which in ("metal", "cuda") and sinks is None:
        out = gpu.paged_attention(which, q, k_cache, v_cache, meta, scale, sliding_window, softcap)
        if out is not None:
            return out
    return reference.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
