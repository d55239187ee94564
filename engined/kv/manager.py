"""The KV cache manager the scheduler allocates through: a model's KV groups, seen as one.

As in vLLM's V1 core, admission is an allocation that succeeds or waits. The
manager is an ordered list of KV groups built from each layer's settings. The
first group is always the full-attention group (``full_attention``): its pool
bounds admission and context, and the memory guard sizes it. The others
(``sliding_window``, ``recurrent_state``; a new kind is one file and a line in
``KINDS``) claim the layers of their kind and follow it:

- a cached prefix is the longest run of leading full blocks every group can
  resume from (each group may only cut it shorter);
- ``allocate`` succeeds for all groups or for none;
- ``commit`` and ``free`` reach every group;
- bytes per block and fixed bytes are the groups' sums.

The chained block hashes live on the request and are computed here once for
every group. Under the groups, an optional disk tier (``disk_tier``) keeps what
leaves their prefix caches and reads it back before a request is admitted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from mlxd.engined.kv.disk_parts import PagedPart, StatePart
from mlxd.engined.kv.disk_store import DiskStore
from mlxd.engined.kv.disk_tier import DiskTier
from mlxd.engined.kv.full_attention import BlockPool, FullAttentionGroup, PagedArrays, extend_hashes
from mlxd.engined.kv.group import Block, KVGroup
from mlxd.engined.kv.recurrent_state import RecurrentStateGroup
from mlxd.engined.kv.sliding_window import SlidingWindowGroup
from mlxd.engined.model_layers import LayerSpec
from mlxd.engined.request import Request
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ModelLoadError
from mlxd.shared.paths import cache_dir

log = logging.getLogger("mlxd.engine")

# Seconds with no request holding a block before the main pool is cut back to its starting size:
# long enough that an agent's pause between turns keeps its grown pool and cached prefixes.
IDLE_RELEASE_S = 30.0

# Kinds that claim layers before the full-attention group takes every attention layer left.
KINDS: tuple[type[KVGroup], ...] = (SlidingWindowGroup, RecurrentStateGroup)


class KVCacheManager:
    def __init__(self, main: FullAttentionGroup, others: list[KVGroup] = (), num_layers: int = 0,
                 disk: DiskTier | None = None):
        self.main = main
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
    def build(cls, specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype,
              settle: Callable[[], None] | None = None, weights: str | None = None) -> "KVCacheManager":
        """Groups for a model's layers (``model_layers.read_layers``); arrays come with ``create``.
        ``settle`` is called before the main pool's arrays are resized (``FullAttentionGroup``).
        ``weights``: the weights' fingerprint, given where the disk tier may serve the engine."""
        others, left = [], list(specs)
        for kind in KINDS:
            group = kind.claim(left, config, dtype)
            if group is not None:
                others.append(group)
                left = [s for s in left if s.index not in group.layers]
        main = FullAttentionGroup.claim(left, config, dtype, settle)
        # A pipeline rank may hold linear layers only; the pool's blocks then cost it nothing.
        if not main.layers and config.pipeline_parallel_size == 1:
            raise ModelLoadError("the model has no attention layer: the paged runner needs at least one")
        return cls(main, others, len(specs), _disk_tier(main, others, config, dtype, weights))

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


def _disk_tier(main: FullAttentionGroup, others: list[KVGroup], config: EngineConfig, dtype: mx.Dtype,
               weights: str | None) -> DiskTier | None:
    """The disk tier under the groups (``disk_tier``), where it is on; one part per group."""
    if not (config.kv_disk_cache and config.enable_prefix_caching and weights is not None and main.layers):
        return None
    parts = [PagedPart(main, main.take_blocks)]
    for g in others:
        if isinstance(g, SlidingWindowGroup):
            parts.append(PagedPart(g))
        elif isinstance(g, RecurrentStateGroup):
            parts.append(StatePart(g))
        else:
            log.info("KV disk cache off: %s is not written to disk", type(g).__name__)
            return None
    # Everything besides the token chain that an entry's content depends on: its namespace.
    identity = {"format": 1, "weights": weights, "dtype": str(dtype), "block_size": config.block_size,
                "parts": [[p.suffix.decode(), p.names, [[list(shape), width] for shape, width in p.layout]]
                          for p in parts],
                "layers": [g.layers for g in (main, *others)], "aliases": main.kv.aliases}
    root = config.kv_cache_dir or os.path.join(cache_dir(), "kv")
    return DiskTier(DiskStore(root, identity, config.kv_disk_budget), parts, config.block_size, main.settle,
                    config.kv_disk_read_timeout)
