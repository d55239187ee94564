"""Sliding-window layers' K/V in a pool of their own, holding only what a window can still see.

In a model that mixes sliding-window and full-attention layers (Gemma 3,
gpt-oss), a window layer never reads a key more than ``window`` positions
back. Its blocks go to a second block pool with its own block tables: a
request holds there only the blocks from its first still-visible one onward,
and older ones are handed back as it advances. That pool is fixed (sized from
``max_num_seqs``, the window and the step's token budget, so it never runs
short) and set aside from the memory budget like other fixed pools; the main
pool, which bounds admission and context, is billed for the full-attention
layers alone.

Prefix caching: window blocks are cached under the same chained hashes as the
main pool's; a cached prefix is used only as far as the window blocks its
next token sees are still cached.
"""

from __future__ import annotations

import mlx.core as mx

from mlxd.engined.kv.manager import BlockPool, PagedArrays
from mlxd.engined.kv.group import Block, KVGroup
from mlxd.engined.model_layers import LayerSpec
from mlxd.engined.request import Request
from mlxd.engined.kernels import AttentionMetadata
from mlxd.shared.config import EngineConfig


def first_visible_block(position: int, window: int, block_size: int) -> int:
    """The first block a query at ``position`` can see through a window of ``window`` keys."""
    return max(0, position - window + 1) // block_size


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks the window pool needs so that allocation never fails: every running request's
    visible history (plus partial blocks at both ends and where its new tokens start), and one
    step's new tokens (requests give back what leaves their window as each step is committed)."""
    per_request = -(-(window - 1) // block_size) + 3
    return max_num_seqs * per_request + -(-max_num_batched_tokens // block_size)


class SlidingWindowGroup(KVGroup):
    def __init__(self, specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype):
        self.layers = [s.index for s in specs]
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.window = max(s.sliding_window for s in specs)
        self.num_blocks = window_pool_blocks(self.window, self.block_size, config.max_num_seqs,
                                             config.max_num_batched_tokens)
        self.kv = PagedArrays(specs, self.block_size, dtype)
        self.pool = BlockPool(0)
        self.tables: dict[str, list[Block | None]] = {}  # logical block -> block; None once out of view

    @classmethod
    def claim(cls, specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype) -> "SlidingWindowGroup | None":
        """The window layers, when full-attention layers are there too (alone, they use the main pool)."""
        window = [s for s in specs if s.sliding_window is not None]
        full = [s for s in specs if s.settings is not None and s.sliding_window is None]
        return cls(window, config, dtype) if window and full else None

    @property
    def fixed_bytes(self) -> int:
        return self.num_blocks * self.kv.bytes_per_block

    def create(self, num_blocks: int, record_evictions: bool = False) -> None:
        size = self.num_blocks if num_blocks else 0
        self.pool = BlockPool(size, record_evictions=record_evictions)
        self.tables = {}
        self.kv.create(size)

    def arrays(self) -> list[mx.array]:
        return self.kv.arrays()

    def _first(self, position: int) -> int:
        return first_visible_block(position, self.window, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's window-pool table; blocks out of view read as block 0 (masked, never written)."""
        return [b.block_id if b is not None else 0 for b in self.tables.get(request_id, ())]

    def prefix_blocks(self, req: Request, num_blocks: int) -> int:
        n = num_blocks
        while n and not all(self.pool.lookup(req.block_hashes[i]) is not None
                            for i in range(self._first(n * self.block_size), n)):
            n -= 1
        return n

    def _trim(self, request_id: str, position: int) -> list[Block | None]:
        """Hand back the request's window blocks a query at ``position`` no longer sees."""
        table = self.tables.get(request_id, [])
        first = min(self._first(position), len(table))
        dropped = [b for b in table[:first] if b is not None]
        if dropped:
            self.pool.free(reversed(dropped))
            table = [None] * first + table[first:]
            self.tables[request_id] = table
        return table

    def _plan(self, req: Request, num_new_tokens: int, prefix: list[Block]):
        """(table before the new blocks, cached window blocks of the prefix, blocks still needed)."""
        computed = req.num_computed_tokens + len(prefix) * self.block_size
        table = self._trim(req.request_id, computed)
        first = self._first(computed)
        cached = [self.pool.lookup(req.block_hashes[i]) for i in range(first, len(prefix))]
        assert all(b is not None for b in cached), "prefix_blocks offers only prefixes whose window is cached"
        if prefix:
            table = [None] * first + cached
        return table, cached, self.blocks_for(computed + num_new_tokens) - len(table)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, req: Request, num_new_tokens: int, prefix: list[Block]) -> bool:
        _, cached, needed = self._plan(req, num_new_tokens, prefix)
        return needed <= self.pool.num_free - sum(1 for b in cached if b.ref_count == 0)

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[Block]) -> None:
        table, cached, needed = self._plan(req, num_new_tokens, prefix)
        self.pool.touch(cached)
        self.tables[req.request_id] = table + self.pool.allocate(max(needed, 0))

    def commit(self, req: Request) -> None:
        table = self.tables[req.request_id]
        if self.enable_caching:
            for i in range(min(req.num_computed_tokens // self.block_size, len(table))):
                if table[i] is not None and table[i].block_hash is None:
                    self.pool.cache(table[i], req.block_hashes[i])
        self._trim(req.request_id, req.num_computed_tokens)  # the next query sees no further back

    def free(self, req: Request) -> None:
        table = self.tables.pop(req.request_id, None)
        if table:
            self.pool.free(reversed([b for b in table if b is not None]))

    def step(self, scheduled, query_lens, seq_lens, caches) -> None:
        tables = [self.block_ids(r.request_id) for r, _ in scheduled]
        self.kv.steps(AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size), caches)
