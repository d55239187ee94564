"""Paged K/V arrays for a set of attention layers, and the per-layer step object attention writes through.

A layer that shares an earlier layer's K/V (Gemma 4's last layers: ``LayerSpec.kv_source``) has no
arrays of its own: its step object is its source's, which it only reads, after the source wrote
this step's K/V. One pool entry serves both layers, and the memory guard bills it once.
"""

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

    # mlx_lm's pipelined models tie a rank's send of its hidden states to its last layer's cache
    # (``cache[-1].keys = mx.depends(cache[-1].keys, h)``), so that evaluating the cache sends.
    @property
    def keys(self) -> mx.array:
        return self._kv.k[self._i]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._kv.k[self._i] = value

    @property
    def offset(self) -> mx.array:
        """Each packed token's position: what mlx_lm's model bodies read from a cache's ``offset``
        (Ministral 3 builds its query scale from it; the paged attention recomputes that per token)."""
        return self.meta.positions

    def read(self) -> tuple[mx.array, mx.array]:
        """The layer's K/V pools as written so far in this forward (for a layer sharing them)."""
        return self._kv.k[self._i], self._kv.v[self._i]

    def write(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write this step's ``k, v [T, H_kv, D]`` at the metadata's slots; returns the layer's new pools."""
        kv, i = self._kv, self._i
        kv.k[i], kv.v[i] = kernels.write_kv(kv.k[i], kv.v[i], k, v, self.meta.slot_mapping)
        return kv.k[i], kv.v[i]


class PagedArrays:
    """Per layer, K and V pools ``[num_blocks, block_size, H_kv, D]`` (replaced as they are written)."""

    def __init__(self, specs: list[LayerSpec], block_size: int, dtype: mx.Dtype):
        own = [s for s in specs if s.kv_source is None]
        self.layers = [s.index for s in own]
        # (sharing layer, source layer): the sharing layer's step is its source's.
        self.aliases = [(s.index, s.kv_source) for s in specs if s.kv_source is not None]
        missing = {src for _, src in self.aliases} - set(self.layers)
        assert not missing, f"layers {sorted(missing)} share their K/V outside this group"
        self.shapes = [(block_size, s.settings.n_kv_heads, s.settings.head_dim) for s in own]
        self.dtype = dtype
        self.k: list[mx.array] = []
        self.v: list[mx.array] = []

    @property
    def bytes_per_block(self) -> int:
        return 2 * sum(int(np.prod(shape)) for shape in self.shapes) * self.dtype.size

    @property
    def array_bytes_per_block(self) -> int:
        """Bytes per block of the largest single array: the most a ``resize`` holds twice at once."""
        return max((int(np.prod(shape)) for shape in self.shapes), default=0) * self.dtype.size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def create(self, num_blocks: int) -> None:
        """(Re)create the pools with ``num_blocks`` blocks each, dropping the old ones first."""
        self.k, self.v = [], []
        self.k = [mx.zeros((num_blocks, *shape), dtype=self.dtype) for shape in self.shapes]
        self.v = [mx.zeros((num_blocks, *shape), dtype=self.dtype) for shape in self.shapes]
        mx.eval(self.k, self.v)

    def resize(self, num_blocks: int) -> None:
        """Grow (zero blocks appended) or cut (tail blocks dropped) every pool to ``num_blocks`` blocks.

        One array at a time, each evaluated before the next, so the transient
        overhead is a single array's new copy; blocks below the cut keep their contents.
        """
        old = self.num_blocks
        if num_blocks == old:
            return
        for pools in (self.k, self.v):
            for i in range(len(pools)):
                if num_blocks > old:
                    pools[i] = mx.pad(pools[i], [(0, num_blocks - old), (0, 0), (0, 0), (0, 0)])
                else:
                    pools[i] = mx.contiguous(pools[i][:num_blocks])  # a copy: a slice would keep the old buffer
                mx.eval(pools[i])

    def arrays(self) -> list[mx.array]:
        return self.k + self.v

    def steps(self, meta: AttentionMetadata, caches: list) -> None:
        """Put each layer's step object for ``meta`` at its place in the model's ``caches`` list."""
        for i, layer in enumerate(self.layers):
            caches[layer] = PagedLayerStep(meta, self, i)
        for layer, source in self.aliases:
            caches[layer] = caches[source]
