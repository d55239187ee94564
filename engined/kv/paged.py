"""Paged K/V arrays for a set of attention layers, and the per-layer step object attention writes through."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import kernels
from engined.model_layers import LayerSpec
from kernels import AttentionMetadata


class PagedLayerStep:
    """What one attention layer gets as its ``cache`` for one forward: the metadata and its K/V pool."""

    __slots__ = ("meta", "_kv", "_i")

    def __init__(self, meta: AttentionMetadata, kv: "PagedArrays", i: int):
        self.meta = meta
        self._kv = kv
        self._i = i

    def write(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write this step's ``k, v [T, H_kv, D]`` at the metadata's slots; returns the layer's new pools."""
        kv, i = self._kv, self._i
        kv.k[i], kv.v[i] = kernels.write_kv(kv.k[i], kv.v[i], k, v, self.meta.slot_mapping)
        return kv.k[i], kv.v[i]


class PagedArrays:
    """Per layer, K and V pools ``[num_blocks, block_size, H_kv, D]`` (replaced as they are written)."""

    def __init__(self, specs: list[LayerSpec], block_size: int, dtype: mx.Dtype):
        self.layers = [s.index for s in specs]
        self.shapes = [(block_size, s.settings.n_kv_heads, s.settings.head_dim) for s in specs]
        self.dtype = dtype
        self.k: list[mx.array] = []
        self.v: list[mx.array] = []

    @property
    def bytes_per_block(self) -> int:
        return 2 * sum(int(np.prod(shape)) for shape in self.shapes) * self.dtype.size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def create(self, num_blocks: int) -> None:
        """(Re)create the pools with ``num_blocks`` blocks each, dropping the old ones first."""
        self.k, self.v = [], []
        self.k = [mx.zeros((num_blocks, *shape), dtype=self.dtype) for shape in self.shapes]
        self.v = [mx.zeros((num_blocks, *shape), dtype=self.dtype) for shape in self.shapes]
        mx.eval(self.k, self.v)

    def arrays(self) -> list[mx.array]:
        return self.k + self.v

    def steps(self, meta: AttentionMetadata, caches: list) -> None:
        """Put each layer's step object for ``meta`` at its place in the model's ``caches`` list."""
        for i, layer in enumerate(self.layers):
            caches[layer] = PagedLayerStep(meta, self, i)
