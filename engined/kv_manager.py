"""Which blocks each request holds, and the prefix-cache lookups that fill them."""

from __future__ import annotations

from engined.block_pool import Block, BlockPool, hash_block
from engined.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[Block]] = {}
        # Prompt tokens looked up in / found in the prefix cache (vLLM's prefix_cache_queries/hits).
        self.queries = 0
        self.hits = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def cached_prefix(self, req: Request) -> list[Block]:
        """The longest chain of cached full blocks that prefixes ``req``'s tokens.

        Stops one token short of the end: the last token is always recomputed
        so that the step yields its logits.
        """
        if not self.enable_caching:
            return []
        self._extend_hashes(req, (req.num_tokens - 1) // self.block_size)
        hits = []
        for block_hash in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[Block] = ()) -> bool:
        """Hold enough blocks for ``num_new_tokens`` more tokens (after ``prefix``); False if the pool can't."""
        held = self.req_blocks.get(req.request_id, [])
        computed = req.num_computed_tokens + len(prefix) * self.block_size
        needed = self.blocks_for(computed + num_new_tokens) - len(held) - len(prefix)
        # Prefix blocks nobody holds sit in the free queue: taking them shrinks it.
        reclaimed = sum(1 for b in prefix if b.ref_count == 0)
        if needed > self.pool.num_free - reclaimed:
            return False
        self.pool.touch(list(prefix))
        self.req_blocks[req.request_id] = held + list(prefix) + self.pool.allocate(max(needed, 0))
        return True

    def commit(self, req: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        full = req.num_computed_tokens // self.block_size
        self._extend_hashes(req, full)
        blocks = self.req_blocks[req.request_id]
        for i in range(full):
            if blocks[i].block_hash is None:
                self.pool.cache(blocks[i], req.block_hashes[i])

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        hashes, bs = req.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], req.cache_salt))
