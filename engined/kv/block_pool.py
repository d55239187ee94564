"""Fixed-size KV blocks: a free queue with LRU eviction, reference counts, and chained hashes.

A block with ``ref_count == 0`` sits in the free queue. If it also carries a
hash, its contents stay valid and findable by that hash until the block is
handed out again (evicted), least recently freed first; so cached prefixes
never reduce capacity.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Hash of a full block, chained on its parent's so equal hashes mean equal prefixes.

    A cryptographic digest, not Python's ``hash``: a collision would hand one
    request another's KV. ``extra`` (the cache salt) enters the first block
    only; the chain carries it to every later block.
    """
    if parent is None:
        h = hashlib.blake2b(len(extra).to_bytes(4, "little") + extra, digest_size=16, person=b"mlxd-first")
    else:
        h = hashlib.blake2b(parent, digest_size=16, person=b"mlxd-chained")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def extend_hashes(req, num_blocks: int, block_size: int) -> None:
    """Grow ``req.block_hashes`` to its first ``num_blocks`` full blocks (hashed once each)."""
    hashes, bs = req.block_hashes, block_size
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], req.cache_salt))


class BlockPool:
    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the front is evicted first.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the front of the free queue, evicting their cached contents.

        They are handed out in block order. Which blocks are evicted does not change, but a
        request that recycles another's run (freed tail first, so queued in reverse) gets it
        back consecutive and ascending, which lets GPU prefill read the cache in place
        (``kernels.gpu``) instead of gathering a copy."""
        assert n <= len(self.free_queue), "caller must check num_free first"
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            assert block.ref_count == 0
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
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
