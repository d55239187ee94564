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
import numpy as np

from engined.block_pool import Block, BlockPool
from engined.kv_manager import KVCacheManager
from engined.request import Request
from engined.runner import ModelRunner
from kernels import AttentionMetadata


def first_visible_block(position: int, window: int, block_size: int) -> int:
    """The first block a query at ``position`` can see through a window of ``window`` keys."""
    return max(0, position - window + 1) // block_size


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks the window pool needs so that allocation never fails: every running request's
    visible history (plus partial blocks at both ends and where its new tokens start), and one
    step's new tokens (requests give back what leaves their window as each step is committed)."""
    per_request = -(-(window - 1) // block_size) + 3
    return max_num_seqs * per_request + -(-max_num_batched_tokens // block_size)


class WindowedKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int, enable_caching: bool, window: int):
        super().__init__(num_blocks, block_size, enable_caching)
        self.window = window
        self.window_pool = BlockPool(num_window_blocks)
        self.req_window: dict[str, list[Block | None]] = {}  # logical block -> block; None once out of view

    def _first(self, position: int) -> int:
        return first_visible_block(position, self.window, self.block_size)

    def window_block_ids(self, request_id: str) -> list[int]:
        """The request's window-pool table; blocks out of view read as block 0 (masked, never written)."""
        return [b.block_id if b is not None else 0 for b in self.req_window.get(request_id, ())]

    def cached_prefix(self, req: Request) -> list[Block]:
        hits = super().cached_prefix(req)
        while hits:
            seen = range(self._first(len(hits) * self.block_size), len(hits))
            if all(self.window_pool.lookup(req.block_hashes[i]) is not None for i in seen):
                break
            hits.pop()
        return hits

    def _trim(self, request_id: str, position: int) -> list[Block | None]:
        """Hand back the request's window blocks a query at ``position`` no longer sees."""
        table = self.req_window.get(request_id, [])
        first = min(self._first(position), len(table))
        dropped = [b for b in table[:first] if b is not None]
        if dropped:
            self.window_pool.free(reversed(dropped))
            table = [None] * first + table[first:]
            self.req_window[request_id] = table
        return table

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[Block] = ()) -> bool:
        computed = req.num_computed_tokens + len(prefix) * self.block_size
        table = self._trim(req.request_id, computed)
        first = self._first(computed)
        cached = [self.window_pool.lookup(req.block_hashes[i]) for i in range(first, len(prefix))]
        assert all(b is not None for b in cached), "cached_prefix offers only prefixes whose window is cached"
        if prefix:
            table = [None] * first + cached
        needed = self.blocks_for(computed + num_new_tokens) - len(table)
        reclaimed = sum(1 for b in cached if b.ref_count == 0)
        if needed > self.window_pool.num_free - reclaimed or not super().allocate(req, num_new_tokens, prefix):
            return False
        self.window_pool.touch(cached)
        self.req_window[req.request_id] = table + self.window_pool.allocate(max(needed, 0))
        return True

    def commit(self, req: Request) -> None:
        super().commit(req)
        table = self.req_window[req.request_id]
        if self.enable_caching:
            for i in range(min(req.num_computed_tokens // self.block_size, len(table))):
                if table[i] is not None and table[i].block_hash is None:
                    self.window_pool.cache(table[i], req.block_hashes[i])
        self._trim(req.request_id, req.num_computed_tokens)  # the next query sees no further back

    def free(self, req: Request) -> None:
        super().free(req)
        table = self.req_window.pop(req.request_id, None)
        if table:
            self.window_pool.free(reversed([b for b in table if b is not None]))


class WindowRunner(ModelRunner):
    """The model runner with a second K/V pool, of ``num_window_blocks`` blocks, for the window layers."""

    def __init__(self, model, block_size: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype):
        super().__init__(model, block_size, num_kv_heads, head_dim, dtype)
        windows = [a.settings.sliding_window for a in self.ctx.attention]
        self.is_window = [w is not None for w in windows]
        self.window = max(w for w in windows if w is not None)
        self.num_window_blocks = 0
        self.kv: WindowedKVCacheManager | None = None  # set by model_kinds.make_kv_manager

    def _layer_bytes(self) -> int:
        return 2 * int(np.prod(self.block_shape)) * self.dtype.size

    @property
    def bytes_per_block(self) -> int:
        """Main-pool bytes per block: the full-attention layers only."""
        return self.is_window.count(False) * self._layer_bytes()

    @property
    def fixed_bytes(self) -> int:
        return self.num_window_blocks * self.is_window.count(True) * self._layer_bytes()

    def allocate_kv(self, num_blocks: int) -> None:
        self.ctx.k_caches, self.ctx.v_caches = [], []
        window_blocks = self.num_window_blocks if num_blocks else 0
        shapes = [(window_blocks if w else num_blocks, *self.block_shape) for w in self.is_window]
        self.ctx.k_caches = [mx.zeros(s, dtype=self.dtype) for s in shapes]
        self.ctx.v_caches = [mx.zeros(s, dtype=self.dtype) for s in shapes]
        mx.eval(self.ctx.k_caches, self.ctx.v_caches)

    def execute(self, scheduled, block_tables, num_logits):
        # Before the KV manager exists (the memory guard's warm-up) the step's own tables
        # fit both pools: the window pool holds at least one step's worth of blocks.
        tables = block_tables if self.kv is None else [self.kv.window_block_ids(r.request_id) for r, _ in scheduled]
        lens = [n for _, n in scheduled]
        self.ctx.window_meta = AttentionMetadata.build(
            lens, [r.num_computed_tokens + n for r, n in scheduled], tables, self.block_size)
        try:
            return super().execute(scheduled, block_tables, num_logits)
        finally:
            self.ctx.window_meta = None
