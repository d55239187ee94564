"""What the disk tier (``disk_tier``) keeps of each KV group, one part per group, keyed by block hash.

A part knows where its group's cached entries live, which blocks a prefix of
``n`` blocks needs of it, how to copy entries to the host and how to put
entries read back into its group:

- ``PagedPart``: a pool of paged K/V blocks. The main pool needs every block
  of the prefix; a sliding-window pool only those its next token sees.
- ``StatePart``: a hybrid model's recurrent-state snapshots; a prefix needs the
  snapshot at its last block.

A part's files are named by the block hash and the part's suffix (none for the
main pool), so the parts of one block are separate files written when each
leaves its own group.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from mlxd.engined.kv.manager import BlockPool, FullAttentionGroup
from mlxd.engined.kv.group import Block
from mlxd.engined.kv.recurrent_state import RecurrentStateGroup
from mlxd.engined.kv.sliding_window import SlidingWindowGroup, first_visible_block

# Host copies hold arrays as unsigned integers of the same width (numpy has no bfloat16); the part
# views them back as its group's dtype.
UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


def to_host(arrays: list[mx.array]) -> list[np.ndarray]:
    """Evaluated arrays as numpy copies of their bytes."""
    return [np.array(a.view(UINT[a.dtype.size])) for a in arrays]


class Part:
    suffix: bytes
    names: list[str]
    prefix = False  # True: a prefix of n blocks needs all of blocks 0..n-1 from this part

    def key(self, block_hash: bytes) -> bytes:
        return block_hash + self.suffix

    def span(self, n: int, block_size: int) -> range:
        """The block indices a cached prefix of ``n`` blocks needs from this part."""
        raise NotImplementedError

    def in_memory(self, block_hash: bytes) -> bool:
        raise NotImplementedError

    def take_evicted(self) -> list:
        """Entries (hash, where) that left the group since the last call, their contents intact."""
        raise NotImplementedError

    def cached(self) -> list:
        """Entries (hash, where) of everything the group has cached now."""
        raise NotImplementedError

    def host(self, entries: list) -> list[dict[str, np.ndarray]]:
        """Host copies of entries' arrays, by name."""
        raise NotImplementedError

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry (one block's file, less its header)."""
        return sum(int(np.prod(shape)) * width for shape, width in self.layout)

    def install(self, hashes: list[bytes], rows: dict[bytes, int], read: dict[str, np.ndarray],
                before_write: Callable[[], None]) -> int:
        """Put the entries read for the blocks ``hashes`` a prefix needs into the group, cached: ``read``
        holds them stacked by name (``DiskStore.read``), block ``h`` at row ``rows[h]``; returns how many.
        ``before_write`` runs once entries were evicted to make room, before their places are overwritten.
        What it writes is evaluated before it returns, on the caller's thread (which waited for any step
        being encoded elsewhere): see ``DiskTier._install``."""
        raise NotImplementedError


class PagedPart(Part):
    def __init__(self, group: FullAttentionGroup | SlidingWindowGroup,
                 take: Callable[[int], list[Block]] | None = None):
        """``take(n)``: n blocks of the group's pool held for contents written from outside a step
        (default: the pool's own allocate; the main pool also sizes its arrays)."""
        self.group = group
        self.window = group.window if isinstance(group, SlidingWindowGroup) else None
        self.prefix = self.window is None
        self.suffix = b"" if self.prefix else b"w"
        self._take = take
        n = len(group.kv.shapes)
        self.names = [f"k{i}" for i in range(n)] + [f"v{i}" for i in range(n)]
        size = group.kv.dtype.size
        self.layout = [(shape, size) for shape in group.kv.shapes * 2]

    @property
    def pool(self) -> BlockPool:
        return self.group.pool  # replaced when the group's arrays are recreated

    def span(self, n: int, block_size: int) -> range:
        if self.window is None:
            return range(n)
        return range(first_visible_block(n * block_size, self.window, block_size), n)

    def in_memory(self, block_hash: bytes) -> bool:
        return self.pool.lookup(block_hash) is not None

    def take_evicted(self) -> list:
        evicted, self.pool.evicted = self.pool.evicted, []
        return evicted

    def cached(self) -> list:
        return [(h, b.block_id) for h, b in self.pool.cached.items()]

    def host(self, entries: list) -> list[dict[str, np.ndarray]]:
        kv = self.group.kv
        ids = mx.array([b for _, b in entries])
        taken = [mx.take(a, ids, axis=0) for a in kv.k + kv.v]
        mx.eval(taken)
        host = to_host(taken)
        return [{name: a[j] for name, a in zip(self.names, host)} for j in range(len(entries))]

    def install(self, hashes, rows, read, before_write) -> int:
        pool = self.pool
        held = [b for h in hashes if (b := pool.lookup(h)) is not None]
        pool.touch(held)  # taking blocks below must not evict the ones the prefix needs
        todo = [(h, rows[h]) for h in hashes if pool.lookup(h) is None and h in rows]
        todo = todo[: pool.num_free]
        blocks = self._take(len(todo)) if self._take is not None else pool.allocate(len(todo))
        before_write()
        if blocks:
            kv = self.group.kv
            ids = mx.array([b.block_id for b in blocks])
            picked = [r for _, r in todo]
            whole = picked == list(range(len(next(iter(read.values())))))
            for i, name in enumerate(self.names):
                arrays = kv.k if name[0] == "k" else kv.v
                layer = i % len(kv.k)
                rows_read = read[name] if whole else read[name][picked]
                arrays[layer][ids] = mx.array(rows_read).view(kv.dtype)
            mx.eval(kv.k, kv.v)  # no step graph may hold this thread's lazy writes (``DiskTier._install``)
            for b, (h, _) in zip(blocks, todo):
                pool.cache(b, h)
        pool.free(list(reversed(held + blocks)))
        return len(blocks)


class StatePart(Part):
    suffix = b"r"

    def __init__(self, group: RecurrentStateGroup):
        self.group = group
        self.layout = [(shape, dtype.size) for layer in group.layer_shapes for shape, dtype in layer]
        self.dtypes = [dtype for layer in group.layer_shapes for _, dtype in layer]
        self.names = [f"s{i}" for i in range(len(self.layout))]

    def _arrays(self) -> list[mx.array]:
        return [a for layer in self.group.states for a in layer]

    def span(self, n: int, block_size: int) -> range:
        return range(n - 1, n) if n else range(0)

    def in_memory(self, block_hash: bytes) -> bool:
        return block_hash in self.group.snapshots

    def take_evicted(self) -> list:
        evicted, self.group.evicted = self.group.evicted, []
        return evicted

    def cached(self) -> list:
        return list(self.group.snapshots.items())

    def host(self, entries: list) -> list[dict[str, np.ndarray]]:
        # ``where`` is a slot (``cached``) or the arrays taken when the slot was evicted.
        taken = [[a[where] for a in self._arrays()] if isinstance(where, int) else where for _, where in entries]
        mx.eval(taken)
        return [dict(zip(self.names, to_host(arrays))) for arrays in taken]

    def install(self, hashes, rows, read, before_write) -> int:
        done = 0
        for h in hashes:
            if h in rows and not self.in_memory(h):
                arrays = [mx.array(read[name][rows[h]]).view(dtype) for name, dtype in zip(self.names, self.dtypes)]
                done += self.group.restore(h, arrays)
        mx.eval(self._arrays())  # as ``PagedPart.install``
        return done
