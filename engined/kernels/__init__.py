"""Paged variable-length attention: one contract, several implementations.

``paged_attention`` runs the implementation its caller names (the engine's
``--attention-backend``): the Metal kernel on a Metal GPU, the CUDA kernel on a
CUDA GPU, the numpy path on the CPU (``host``, float32), or the pure-MLX
reference. ``auto`` picks by the current default device. Any of them falls back
to the reference for a shape or dtype it does not cover. The engine picks once,
at start-up (``implementation``), and its layers call the chosen function
directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from mlxd.engined.kernels import gpu, gpu_geometry, paged_kv
from mlxd.engined.kernels.paged_kv import AttentionMetadata, write_kv

__all__ = ["BACKENDS", "AttentionMetadata", "paged_attention", "replay_key", "resolve_backend", "write_kv"]

BACKENDS = ("auto", "reference", "host", "metal", "cuda")


def resolve_backend(requested: str = "auto") -> str:
    """The implementation ``paged_attention(..., backend=requested)`` uses on the current default device."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested != "auto":
        return requested
    if mx.default_device().type != mx.DeviceType.gpu:
        return "host"
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "reference"


def implementation(backend: str = "auto") -> Callable[..., mx.array]:
    """The function ``paged_attention(..., backend=backend)`` runs: ``paged_attention``'s signature
    without ``backend``, falling back to the reference by itself for what it does not cover."""
    which = resolve_backend(backend)
    if which == "host":
        return paged_kv.host_attention
    if which in ("metal", "cuda"):
        return functools.partial(gpu.attention, which)
    return paged_kv.reference_attention


def replay_key(backend: str, meta: AttentionMetadata) -> tuple | None:
    """What the graph ``implementation(backend)`` builds for ``meta`` takes from the host beyond its
    arrays' shapes, or None where a graph built for one step cannot be replayed on another's arrays.

    Only steps of decode rows replay: a chunk's length and position shape its graph. The host
    path reads its inputs on the host while the graph is built, so it never replays; the GPU
    kernels' launch depends on how many partitions the longest context takes.
    """
    if len(meta.query_lens_np) != meta.num_tokens:
        return None
    which = resolve_backend(backend)
    if which == "host":
        return None
    return gpu_geometry.plan_partitions(meta, which) if which in ("metal", "cuda") else ()


def paged_attention(
    q: mx.array,
    k_cache: mx.array,
    v_cache: mx.array,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
    backend: str = "auto",
) -> mx.array:
    """Attention of packed queries ``q [T, H, D]`` over each request's paged context.

    Same contract as ``paged_kv.reference_attention`` (see there); returns ``[T, H, D]``
    in ``q``'s dtype. The GPU kernels do not take ``sinks`` yet: with sinks the
    reference runs. ``backend`` is one of BACKENDS (see ``resolve_backend``).
    """
    return implementation(backend)(q, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
