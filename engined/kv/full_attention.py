"""Full-attention layers: the main block pool, which bounds admission and context, and the prefix cache.

Every request holds a table of blocks of ``block_size`` tokens each; a full
block is registered under its chained hash once computed, so a later request
with the same prefix takes a reference to it instead of computing it again
(``block_pool`` keeps freed blocks findable until they are handed out again).
The memory guard sizes this pool from the budget; every other group is sized
from the configuration and set aside first.

Only the pool's resident blocks have K/V arrays: they start at the size of one
full-length request and follow the pool as it grows (an allocation that would
otherwise evict or run short) and shrinks (``shrink``, after idle). Arrays
indexed by this pool's block ids elsewhere (a draft model's K/V) ``follow`` it.

The paged K/V arrays (``PagedArrays``) and the per-layer step object attention
writes through (``PagedLayerStep``) are defined here and serve the sliding
window group and a draft model too. A layer that shares an earlier layer's K/V
(Gemma 4's last layers: ``LayerSpec.kv_source``) has no arrays of its own: its
step object is its source's, which it only reads, after the source wrote this
step's K/V. One pool entry serves both layers, and the memory guard bills it
once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import kernels
from engined.kv.block_pool import Block, BlockPool
from engined.kv.group import KVGroup
from engined.model_layers import LayerSpec
from engined.request import Request
from kernels import AttentionMetadata
from shared.config import EngineConfig


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


class FullAttentionGroup(KVGroup):
    def __init__(self, specs: list[LayerSpec], block_size: int, enable_caching: bool, dtype: mx.Dtype):
        self.layers = [s.index for s in specs]
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv = PagedArrays(specs, block_size, dtype)
        self.pool = BlockPool(0)
        self.tables: dict[str, list[Block]] = {}
        self.followers: list[PagedArrays] = []
        self.floor = 0  # the resident size the pool starts at and never shrinks below
        self._resident = 0  # blocks the arrays hold now

    @classmethod
    def claim(cls, specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype) -> "FullAttentionGroup":
        """Every attention layer left: full attention, and windowed layers with no pool of their own
        (their window is then applied by the kernel over the whole table)."""
        return cls([s for s in specs if s.settings is not None], config.block_size,
                   config.enable_prefix_caching, dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block

    def create(self, num_blocks: int, resident: int | None = None) -> None:
        """A pool of ``num_blocks`` blocks, of which ``resident`` (default: all) have arrays now."""
        self.pool = BlockPool(num_blocks, resident)
        self.tables = {}
        self.floor = self._resident = self.pool.num_resident
        for arrays in (self.kv, *self.followers):
            arrays.create(self._resident)

    def _fit_arrays(self) -> None:
        """Resize the arrays to the pool's resident blocks after it grew or shrank."""
        n = self.pool.num_resident
        if n != self._resident:
            # The step's scratch is idle now: giving MLX's buffer cache back first makes room
            # for the one array a resize holds twice (the memory guard counts on it).
            mx.clear_cache()
            for arrays in (self.kv, *self.followers):
                arrays.resize(n)
            self._resident = n

    def shrink(self) -> None:
        """Cut the pool back towards its starting size, keeping every block a request holds
        (cached prefixes past the cut are dropped)."""
        self.pool.shrink(self.floor)
        self._fit_arrays()

    def arrays(self) -> list[mx.array]:
        return self.kv.arrays()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def prefix_blocks(self, req: Request, num_blocks: int) -> int:
        n = 0
        while n < num_blocks and self.pool.lookup(req.block_hashes[n]) is not None:
            n += 1
        return n

    def prefix(self, req: Request, num_blocks: int) -> list[Block]:
        """The cached blocks of the request's first ``num_blocks`` (all cached: ``prefix_blocks`` said so)."""
        return [self.pool.lookup(h) for h in req.block_hashes[:num_blocks]]

    def _needed(self, req: Request, num_new_tokens: int, prefix: list[Block]) -> int:
        computed = req.num_computed_tokens + len(prefix) * self.block_size
        return self.blocks_for(computed + num_new_tokens) - len(self.tables.get(req.request_id, ())) - len(prefix)

    def can_allocate(self, req: Request, num_new_tokens: int, prefix: list[Block]) -> bool:
        # Prefix blocks nobody holds sit in the free queue: taking them shrinks it.
        reclaimed = sum(1 for b in prefix if b.ref_count == 0)
        return self._needed(req, num_new_tokens, prefix) <= self.pool.num_free - reclaimed

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[Block]) -> None:
        needed = self._needed(req, num_new_tokens, prefix)
        self.pool.touch(list(prefix))
        held = self.tables.get(req.request_id, [])
        self.tables[req.request_id] = held + list(prefix) + self.pool.allocate(max(needed, 0))
        self._fit_arrays()

    def commit(self, req: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache (hashes computed)."""
        if not self.enable_caching:
            return
        blocks = self.tables[req.request_id]
        for i in range(req.num_computed_tokens // self.block_size):
            if blocks[i].block_hash is None:
                self.pool.cache(blocks[i], req.block_hashes[i])

    def free(self, req: Request) -> None:
        blocks = self.tables.pop(req.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def step(self, scheduled, query_lens, seq_lens, caches) -> None:
        tables = [self.block_ids(r.request_id) for r, _ in scheduled]
        self.kv.steps(AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size), caches)
