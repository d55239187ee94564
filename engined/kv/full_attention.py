"""Full-attention layers: the main block pool, which bounds admission and context, and the prefix cache.

Every request holds a table of blocks of ``block_size`` tokens each; a full
block is registered under its chained hash once computed, so a later request
with the same prefix takes a reference to it instead of computing it again
(``block_pool`` keeps freed blocks findable until they are handed out again).
The memory guard sizes this pool from the budget; every other group is sized
from the configuration and set aside first.
"""

from __future__ import annotations

import mlx.core as mx

from engined.kv.block_pool import Block, BlockPool
from engined.kv.group import KVGroup
from engined.kv.paged import PagedArrays
from engined.model_layers import LayerSpec
from engined.request import Request
from kernels import AttentionMetadata
from shared.config import EngineConfig


class FullAttentionGroup(KVGroup):
    def __init__(self, specs: list[LayerSpec], block_size: int, enable_caching: bool, dtype: mx.Dtype):
        self.layers = [s.index for s in specs]
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv = PagedArrays(specs, block_size, dtype)
        self.pool = BlockPool(0)
        self.tables: dict[str, list[Block]] = {}

    @classmethod
    def claim(cls, specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype) -> "FullAttentionGroup":
        """Every attention layer left: full attention, and windowed layers with no pool of their own
        (their window is then applied by the kernel over the whole table)."""
        return cls([s for s in specs if s.settings is not None], config.block_size,
                   config.enable_prefix_caching, dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block

    def create(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.tables = {}
        self.kv.create(num_blocks)

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
