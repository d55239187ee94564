"""The KV cache manager the scheduler allocates through, and its main group: full attention's block pool.

As in vLLM's V1 core, admission is an allocation that succeeds or waits. The
manager is an ordered list of KV groups. The first is always the full-attention
group (``FullAttentionGroup``, below): its pool bounds admission and context,
and the memory guard sizes it. The others (``sliding_window``,
``recurrent_state``; ``kinds`` builds a model's manager from its layers) claim
the layers of their kind and follow it:

- a cached prefix is the longest run of leading full blocks every group can
  resume from (each group may only cut it shorter);
- ``allocate`` succeeds for all groups or for none;
- ``commit`` and ``free`` reach every group;
- bytes per block and fixed bytes are the groups' sums.

The chained block hashes live on the request and are computed here once for
every group. Under the groups, an optional disk tier (``disk_tier``) keeps what
leaves their prefix caches and reads it back before a request is admitted.

The full-attention group. Every request holds a table of blocks of
``block_size`` tokens each; a full block is registered under its chained hash
once computed, so a later request with the same prefix takes a reference to it
instead of computing it again (the pool keeps freed blocks findable until they
are handed out again). The memory guard sizes this pool from the budget; every
other group is sized from the configuration and set aside first.

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

The block pool (``BlockPool``, at the end; the sliding-window group keeps one
too) hands out fixed-size blocks by reference count and finds cached ones by
their chained hash. A block with ``ref_count == 0`` sits in the free queue. If it also carries a
hash, its contents stay valid and findable by that hash until the block is
handed out again (evicted), least recently freed first; so cached prefixes
never reduce capacity.

The pool has a fixed ``capacity`` (what admission counts on) but only its
first ``num_resident`` blocks exist: the owner's arrays follow that number.
Blocks are added at the tail in large steps when an allocation would otherwise
evict a cached prefix or run short, and ``shrink`` cuts free tail blocks off
again, so resident memory follows demand while every block id stays valid.

Over 400 lines because the manager and its main group are one state seen from two sides: most of the
manager's calls are the main pool's (admission, context, resizing, the idle cut-back), and the pool,
its prefix cache and the paged arrays sized to it change together in allocate, commit and resize (the
sliding-window group reuses the pool and the arrays from here).
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from mlxd.engined import kernels
from mlxd.engined.kernels import AttentionMetadata
from mlxd.engined.kv.group import Block, KVGroup
from mlxd.engined.model_layers import LayerSpec
from mlxd.engined.request import Request
from mlxd.shared.config import EngineConfig

# Seconds with no request holding a block before the main pool is cut back to its starting size:
# long enough that an agent's pause between turns keeps its grown pool and cached prefixes.
IDLE_RELEASE_S = 30.0


class KVCacheManager:
    def __init__(self, main: FullAttentionGroup, others: list[KVGroup] = (), num_layers: int = 0, disk=None):
        self.main = main
        # The disk tier under the groups (``disk_tier.DiskTier``), or None: off.
        self.disk = disk
        self.groups: list[KVGroup] = [main, *others]
        self.block_size = main.block_size
        self.enable_caching = main.enable_caching
        self.num_layers = num_layers
        # Prompt tokens looked up in / found in the prefix cache (vLLM's prefix_cache_queries/hits).
        self.queries = 0
        self.hits = 0
        self._idle_since: float | None = None  # when ``release_idle`` first saw no block held

    @classmethod
    def blocks_only(cls, num_blocks: int, block_size: int, enable_caching: bool) -> "KVCacheManager":
        """A manager of the main pool alone, with no arrays (scheduler tests, no model)."""
        kv = cls(FullAttentionGroup([], block_size, enable_caching, mx.float32))
        kv.create(num_blocks)
        return kv

    # -- memory ------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        return sum(g.bytes_per_block for g in self.groups)

    @property
    def fixed_bytes(self) -> int:
        return sum(g.fixed_bytes for g in self.groups)

    @property
    def can_rewind(self) -> bool:
        """Whether tokens computed past what is kept (rejected drafts) can be taken back."""
        return all(g.can_rewind for g in self.groups)

    @property
    def resize_bytes_per_block(self) -> int:
        """Per block of the main pool, the largest array it resizes: the transient a growth step holds."""
        return self.main.kv.array_bytes_per_block

    def create(self, num_blocks: int, resident: int | None = None) -> None:
        """(Re)create every group's pools for a main pool of ``num_blocks`` blocks, ``resident`` of
        them (default: all) with arrays now; 0 drops them."""
        self.main.create(num_blocks, resident, record_evictions=self.disk is not None)
        for g in self.groups[1:]:
            g.create(num_blocks, record_evictions=self.disk is not None)

    def add(self, group: KVGroup) -> None:
        """A group that claims none of the model's layers but keeps K/V per block of the main pool
        (an MTP layer's, ``kv/mtp_layer.py``): billed with the groups, its arrays following the pool."""
        self.groups.append(group)
        self.follow(group.kv)

    def follow(self, arrays: PagedArrays) -> None:
        """Keep ``arrays`` (indexed by the main pool's block ids) sized to the main pool's resident blocks."""
        self.main.followers.append(arrays)

    def release_idle(self, now: float) -> bool:
        """Cut the main pool back once no request has held a block for ``IDLE_RELEASE_S`` seconds
        (``now`` on ``time.monotonic``'s clock) and hand MLX's freed buffers back; True if it did."""
        if self.main.tables:
            self._idle_since = None
            return False
        if self._idle_since is None:
            self._idle_since = now
            if self.disk is not None:  # once per pause: what a restart should find
                self.disk.persist()
        if now - self._idle_since < IDLE_RELEASE_S or self.pool.num_resident <= self.main.floor:
            return False
        self.main.shrink(self.disk.spill if self.disk is not None else lambda: None)
        mx.clear_cache()
        return True

    def arrays(self) -> list[mx.array]:
        return [a for g in self.groups for a in g.arrays()]

    @property
    def nbytes(self) -> int:
        """Bytes of every array the groups hold now (main pool and fixed pools)."""
        return sum(a.nbytes for a in self.arrays())

    # -- the main pool -------------------------------------------------------------------------

    @property
    def pool(self) -> BlockPool:
        return self.main.pool

    @property
    def req_blocks(self) -> dict[str, list[Block]]:
        return self.main.tables

    @property
    def num_free_blocks(self) -> int:
        return self.main.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return self.main.blocks_for(num_tokens)

    def block_ids(self, request_id: str) -> np.ndarray:
        return self.main.block_ids(request_id)

    # -- per request ---------------------------------------------------------------------------

    def cached_prefix(self, req: Request) -> list[Block]:
        """The longest chain of cached full blocks that prefixes ``req``'s tokens and every group can use.

        Stops one token short of the end: the last token is always recomputed
        so that the step yields its logits.
        """
        if not self.enable_caching:
            return []
        n = (req.num_tokens - 1) // self.block_size
        extend_hashes(req, n, self.block_size)
        while True:
            cut = n
            for g in self.groups:
                cut = g.prefix_blocks(req, cut)
            if cut == n:
                return self.main.prefix(req, n)
            n = cut

    def reading(self, req: Request) -> bool:
        """Whether ``req``, waiting, waits for blocks of its prefix being read from disk (the scheduler
        steps over it meanwhile, as over a request whose blocks are being computed)."""
        return (self.disk is not None and req.num_computed_tokens == 0
                and self.disk.reading(req, lambda: len(self.cached_prefix(req))))

    def reads(self) -> list:
        """Futures of the disk reads in progress (an idle engine waits on them)."""
        return self.disk.futures() if self.disk is not None else []

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[Block] = ()) -> bool:
        """Hold room for ``num_new_tokens`` more tokens (after ``prefix``) in every group; False if one can't."""
        prefix = list(prefix)
        if not all(g.can_allocate(req, num_new_tokens, prefix) for g in self.groups):
            return False
        for g in self.groups:
            g.allocate(req, num_new_tokens, prefix)
        if self.disk is not None:
            self.disk.spill()
        self._idle_since = None
        return True

    def commit(self, req: Request) -> None:
        """After a step advanced the request: register its completed blocks, drop what is out of use."""
        if self.enable_caching:
            extend_hashes(req, req.num_computed_tokens // self.block_size, self.block_size)
        for g in self.groups:
            g.commit(req)

    def free(self, req: Request) -> None:
        for g in self.groups:
            g.free(req)
        if self.disk is not None:
            self.disk.forget(req)

    # -- per step ------------------------------------------------------------------------------

    def step_caches(self, scheduled: list[tuple[Request, int]]) -> list:
        """The model's ``cache`` argument for this step: one step object per layer, from its group."""
        query_lens = [n for _, n in scheduled]
        seq_lens = [r.num_computed_tokens + n for r, n in scheduled]
        caches = [None] * self.num_layers
        for g in self.groups:
            g.step(scheduled, query_lens, seq_lens, caches)
        return caches


# The main group: full attention, its paged arrays and its block pool.


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

    @property
    def arrays(self) -> "PagedArrays":
        return self._kv

    def rebound(self, meta: AttentionMetadata, kv: "PagedArrays") -> "PagedLayerStep":
        """The same layer's step over other metadata and pools (those a compiled step traces with)."""
        return PagedLayerStep(meta, kv, self._i)

    def read(self) -> tuple[mx.array, mx.array]:
        """The layer's K/V pools as written so far in this forward (for a layer sharing them)."""
        return self._kv.k[self._i], self._kv.v[self._i]

    def write(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write this step's ``k, v [T, H_kv, D]`` at the metadata's slots; returns the layer's new pools."""
        kv, i = self._kv, self._i
        kv.k[i], kv.v[i] = kernels.write_kv(kv.k[i], kv.v[i], k, v, self.meta)
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

    def holding(self, pools: list[mx.array]) -> "PagedArrays":
        """These layers over other pools, K's then V's as ``arrays`` lists them (a compiled step's traced ones)."""
        other = copy.copy(self)
        n = len(self.k)
        other.k, other.v = list(pools[:n]), list(pools[n:])
        return other

    def steps(self, meta: AttentionMetadata, caches: list) -> None:
        """Put each layer's step object for ``meta`` at its place in the model's ``caches`` list."""
        for i, layer in enumerate(self.layers):
            caches[layer] = PagedLayerStep(meta, self, i)
        for layer, source in self.aliases:
            caches[layer] = caches[source]


class FullAttentionGroup(KVGroup):
    def __init__(self, specs: list[LayerSpec], block_size: int, enable_caching: bool, dtype: mx.Dtype,
                 settle: Callable[[], None] | None = None):
        self.layers = [s.index for s in specs]
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv = PagedArrays(specs, block_size, dtype)
        self.pool = BlockPool(0)
        self.tables: dict[str, list[Block]] = {}
        # Per request, its tables' block ids, and how many of its leading blocks are known hashed: kept as
        # the tables grow, so a step's work per request does not grow with its context.
        self._ids: dict[str, BlockIds] = {}
        self._hashed: dict[str, int] = {}
        self.followers: list[PagedArrays] = []
        self.floor = 0  # the resident size the pool starts at and never shrinks below
        self._resident = 0  # blocks the arrays hold now
        # Called before the arrays are resized: an engine whose steps are encoded on another thread
        # waits there for the step in flight (engined/fastpath/encode_thread.py).
        self.settle: Callable[[], None] = settle or (lambda: None)

    @classmethod
    def claim(cls, specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype,
              settle: Callable[[], None] | None = None) -> "FullAttentionGroup":
        """Every attention layer left: full attention, and windowed layers with no pool of their own
        (their window is then applied by the kernel over the whole table); ``settle``: see ``__init__``."""
        return cls([s for s in specs if s.settings is not None], config.block_size,
                   config.enable_prefix_caching, dtype, settle)

    @property
    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block

    def create(self, num_blocks: int, resident: int | None = None, record_evictions: bool = False) -> None:
        """A pool of ``num_blocks`` blocks, of which ``resident`` (default: all) have arrays now;
        ``record_evictions``: see ``BlockPool``."""
        self.pool = BlockPool(num_blocks, resident, record_evictions)
        self.tables, self._ids, self._hashed = {}, {}, {}
        self.floor = self._resident = self.pool.num_resident
        for arrays in (self.kv, *self.followers):
            arrays.create(self._resident)

    def _fit_arrays(self) -> None:
        """Resize the arrays to the pool's resident blocks after it grew or shrank."""
        n = self.pool.num_resident
        if n != self._resident:
            self.settle()
            # The step's scratch is idle now: giving MLX's buffer cache back first makes room
            # for the one array a resize holds twice (the memory guard counts on it).
            mx.clear_cache()
            for arrays in (self.kv, *self.followers):
                arrays.resize(n)
            self._resident = n

    def shrink(self, before_cut: Callable[[], None] = lambda: None) -> None:
        """Cut the pool back towards its starting size, keeping every block a request holds
        (cached prefixes past the cut are dropped; ``before_cut`` runs while their K/V are still there)."""
        self.pool.shrink(self.floor)
        before_cut()
        self._fit_arrays()

    def take_blocks(self, n: int) -> list[Block]:
        """``n`` blocks held for contents written from outside a step (the disk tier), arrays sized;
        the caller caches and frees them."""
        blocks = self.pool.allocate(n)
        self._fit_arrays()
        return blocks

    def arrays(self) -> list[mx.array]:
        return self.kv.arrays()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> np.ndarray:
        """The request's table as block ids (int32; a view of the group's own buffer, for reading)."""
        ids = self._ids.get(request_id)
        return ids.view() if ids is not None else np.zeros(0, np.int32)

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
        if needed <= 0 and not prefix:  # most decode steps: the table's last block has room
            return
        self.pool.touch(list(prefix))
        added = list(prefix) + self.pool.allocate(max(needed, 0))
        self.tables.setdefault(req.request_id, []).extend(added)
        self._ids.setdefault(req.request_id, BlockIds()).extend([b.block_id for b in added])
        self._fit_arrays()

    def commit(self, req: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache (hashes computed)."""
        if not self.enable_caching:
            return
        blocks = self.tables[req.request_id]
        start, full = self._hashed.get(req.request_id, 0), req.num_computed_tokens // self.block_size
        for i in range(start, full):
            if blocks[i].block_hash is None:
                self.pool.cache(blocks[i], req.block_hashes[i])
        self._hashed[req.request_id] = max(start, full)

    def free(self, req: Request) -> None:
        blocks = self.tables.pop(req.request_id, None)
        self._ids.pop(req.request_id, None)
        self._hashed.pop(req.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def step(self, scheduled, query_lens, seq_lens, caches) -> None:
        tables = [self.block_ids(r.request_id) for r, _ in scheduled]
        self.kv.steps(AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size), caches)


class BlockIds:
    """A request's block ids in a buffer grown by doubling: its row of a step's block table is a slice of it,
    not a list rebuilt every step. Appending never changes ids already there, so a view handed out stays
    right."""

    __slots__ = ("_buf", "_n")

    def __init__(self):
        self._buf = np.zeros(16, dtype=np.int32)
        self._n = 0

    def extend(self, ids: list[int]) -> None:
        end = self._n + len(ids)
        if end > len(self._buf):
            grown = np.zeros(max(end, 2 * len(self._buf)), dtype=np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : end] = ids
        self._n = end

    def view(self) -> np.ndarray:
        return self._buf[: self._n]


# The block pool: free queue with LRU eviction, reference counts, chained hashes.


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"", images: bytes = b"") -> bytes:
    """Hash of a full block, chained on its parent's so equal hashes mean equal prefixes.

    A cryptographic digest, not Python's ``hash``: a collision would hand one
    request another's KV. ``extra`` (the cache salt) enters the first block
    only; the chain carries it to every later block. ``images`` names the images whose tokens the
    block holds (``image_keys``): equal placeholder tokens of different images differ in K/V.
    """
    if parent is None:
        h = hashlib.blake2b(len(extra).to_bytes(4, "little") + extra, digest_size=16, person=b"mlxd-first")
    else:
        h = hashlib.blake2b(parent, digest_size=16, person=b"mlxd-chained")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(images)
    return h.digest()


def image_keys(req, start: int, end: int) -> bytes:
    """The content hash and prompt offset of each of ``req``'s images with tokens in ``[start, end)``."""
    return b"".join(f"{i.mm_hash}@{i.offset};".encode() for i in req.images or ()
                    if i.offset < end and i.offset + i.length > start)


def extend_hashes(req, num_blocks: int, block_size: int) -> None:
    """Grow ``req.block_hashes`` to its first ``num_blocks`` full blocks (hashed once each)."""
    hashes, bs = req.block_hashes, block_size
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], req.cache_salt,
                                 image_keys(req, i * bs, (i + 1) * bs)))


class BlockPool:
    def __init__(self, num_blocks: int, num_resident: int | None = None, record_evictions: bool = False):
        """``num_blocks`` is the capacity; ``num_resident`` (default: all of it) the blocks that exist now.
        With ``record_evictions``, each cached block evicted or cut off is listed in ``evicted`` as
        (hash, block id) for its owner to take (the disk tier), its K/V still intact until then."""
        resident = num_blocks if num_resident is None else min(num_resident, num_blocks)
        self.capacity = num_blocks
        self.blocks = [Block(i) for i in range(resident)]
        # Insertion order is eviction order: the front is evicted first.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.evicted: list[tuple[bytes, int]] | None = [] if record_evictions else None

    @property
    def num_blocks(self) -> int:
        """The capacity: every block the pool may ever hold (the unit admission counts in)."""
        return self.capacity

    @property
    def num_resident(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Free blocks, counting those not resident yet (allocation adds them as needed)."""
        return len(self.free_queue) + self.capacity - len(self.blocks)

    def _shortfall(self, n: int) -> int:
        """How many of ``n`` blocks the queue's front lacks before it would run out or reach a cached
        prefix (0 once the pool is at its capacity: then it evicts, least recently used first)."""
        if len(self.blocks) == self.capacity:
            return 0
        fresh = 0
        for block in self.free_queue.values():
            if fresh == n or block.block_hash is not None:
                break
            fresh += 1
        return n - fresh

    def _grow(self, shortfall: int) -> None:
        """Add ``shortfall`` blocks or, in one large step, as many as the pool has (capped at the
        capacity), at the front of the free queue: fresh blocks go out before a cached prefix is evicted."""
        old = len(self.blocks)
        new = min(self.capacity, max(2 * old, old + shortfall))
        fresh = [Block(i) for i in range(old, new)]
        self.blocks += fresh
        for block in reversed(fresh):
            self.free_queue[block.block_id] = block
            self.free_queue.move_to_end(block.block_id, last=False)

    def shrink(self, floor: int) -> int:
        """Cut the resident blocks to the fewest (at least ``floor``) that keep every held block;
        cached prefixes past the cut are dropped. Returns the new resident count."""
        held = max((b.block_id for b in self.blocks if b.ref_count), default=-1)
        cut = min(len(self.blocks), max(floor, held + 1))
        for block in self.blocks[cut:]:
            del self.free_queue[block.block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.evicted is not None:
                    self.evicted.append((block.block_hash, block.block_id))
        del self.blocks[cut:]
        return cut

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the front of the free queue, evicting their cached contents.

        They are handed out in block order. Which blocks are evicted does not change, but a
        request that recycles another's run (freed tail first, so queued in reverse) gets it
        back consecutive and ascending, which lets GPU prefill read the cache in place
        (``engined.kernels.gpu``) instead of gathering a copy."""
        assert n <= self.num_free, "caller must check num_free first"
        shortfall = self._shortfall(n)
        if shortfall:
            self._grow(shortfall)
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            assert block.ref_count == 0
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.evicted is not None:
                        self.evicted.append((block.block_hash, block.block_id))
                block.block_hash = None
            block.ref_count = 1
            out.append(block)
        out.sort(key=lambda b: b.block_id)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference to cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference to each block; pass them tail first so a prefix's tail is evicted first."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Register a full block under its chained hash (first writer wins)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def check_whole(self) -> None:
        """Invariant when no request holds blocks: every block free, no reference left."""
        assert len(self.free_queue) == len(self.blocks)
        assert all(b.ref_count == 0 for b in self.blocks)
        ids = np.fromiter(self.free_queue.keys(), dtype=np.int64)
        assert len(np.unique(ids)) == len(self.blocks)
