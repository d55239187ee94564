"""The prefix cache's disk tier: the main pool's cached blocks written out, and read back for requests.

Out: a cached block is copied to the host and queued for the disk store
(``disk_store``) when the pool evicts it (an allocation takes it, or the idle
pool is cut back), and, while no request holds a block, every cached block not
written yet is (so that a restart, or a crash after a pause, finds the blocks
of the last sessions). The copy is taken on the engine thread, before the step
that overwrites the block is built; the disk is written on the store's thread.

In: before a waiting request is admitted, the blocks that continue its cached
prefix past what the pool holds are looked up in the store's index; if there
are any, they are read on the store's thread while the scheduler steps over
the request (it waits as it would for blocks being computed; other requests
run). Once read, they are put into free blocks of the pool and cached under
their hashes, and the request's lookup finds them like any cached prefix: its
``num_cached_tokens`` counts them. A block missing or not intact on disk ends
the run there: the rest is computed.

Only the main pool's K/V go to disk, so the tier serves models whose KV is the
main pool alone (full attention, or windowed layers kept in it): a window pool,
a recurrent state or arrays following the pool (a draft model's) have no disk
copy, and the manager builds no tier for them.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxd.engined.kv.disk_store import DiskStore
from mlxd.engined.kv.full_attention import FullAttentionGroup, extend_hashes
from mlxd.engined.request import Request

# Host arrays hold K/V as unsigned integers of the same width (numpy has no bfloat16); the
# namespace records the dtype they are viewed back as.
_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


def weights_fingerprint(model) -> str:
    """A digest of the model's parameters: each one's name, shape, dtype and 256 values spread over it.

    Reading every byte of a large model would add minutes to each start; a fine-tune or another
    quantization changes values throughout, so a sample tells checkpoints apart.
    """
    params = tree_flatten(model.parameters())
    samples = []
    for _, a in params:
        flat = a.reshape(-1)
        samples.append(flat[:: max(1, flat.size // 256)][:256].view(_UINT[a.dtype.size]))
    mx.eval(samples)
    h = hashlib.blake2b(digest_size=16, person=b"mlxd-weights")
    for (name, a), sample in zip(params, samples):
        h.update(f"{name}:{a.shape}:{a.dtype}".encode())
        h.update(np.array(sample).tobytes())
    return h.hexdigest()


class DiskTier:
    def __init__(self, store: DiskStore, group: FullAttentionGroup):
        self.store = store
        self.group = group
        # Per waiting request looked up: None (nothing to read, or read and put in the pool), or the
        # run of blocks being read: (blocks of its prefix the pool held then, future of the arrays).
        self._reads: dict[str, tuple[int, Future] | None] = {}
        self._names = [f"k{i}" for i in range(len(group.kv.shapes))] + [f"v{i}" for i in range(len(group.kv.shapes))]

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    # -- out --------------------------------------------------------------------------------------

    def spill(self) -> None:
        """Queue the blocks the pool evicted since the last call (their K/V still intact) for writing."""
        pool = self.group.pool
        evicted, pool.evicted = pool.evicted, []
        evicted = [(h, b) for h, b in evicted if not self.store.has(h)]
        if evicted and self.store.enabled:
            self._write(evicted)

    def persist(self) -> None:
        """Queue every cached block of the pool that the store lacks (while no request holds one)."""
        if not self.store.enabled:
            return
        todo = [(h, b.block_id) for h, b in self.group.pool.cached.items() if not self.store.has(h)]
        if todo:
            self._write(todo)

    def _write(self, blocks: list[tuple[bytes, int]]) -> None:
        kv = self.group.kv
        self.group.settle()  # the arrays may be the outputs of a step another thread is encoding
        ids = mx.array([b for _, b in blocks])
        taken = [mx.take(a, ids, axis=0) for a in kv.k + kv.v]
        mx.eval(taken)
        host = [np.array(a.view(_UINT[a.dtype.size])) for a in taken]
        for j, (h, _) in enumerate(blocks):
            self.store.write(h, {name: a[j] for name, a in zip(self._names, host)})

    # -- in ---------------------------------------------------------------------------------------

    def reading(self, req: Request) -> bool:
        """Whether ``req`` (waiting, nothing computed) waits for blocks of its prefix being read."""
        rid = req.request_id
        if rid in self._reads:
            entry = self._reads[rid]
            if entry is None:
                return False
            held, future = entry
            if not future.done():
                return True
            self._reads[rid] = None
            self._install(req, held, future.result())
            return False
        self._reads[rid] = None
        if not self.store.enabled:
            return False
        bs = self.group.block_size
        n = (req.num_tokens - 1) // bs  # the last token is always computed (``cached_prefix``)
        extend_hashes(req, n, bs)
        held = self.group.prefix_blocks(req, n)
        keys = []
        for h in req.block_hashes[held:n]:
            if not self.store.has(h):
                break
            keys.append(h)
        if not keys:
            return False
        self._reads[rid] = (held, self.store.read(keys))
        return True

    def futures(self) -> list[Future]:
        """The reads in progress (an idle engine waits on them)."""
        return [e[1] for e in self._reads.values() if e is not None and not e[1].done()]

    def forget(self, req: Request) -> None:
        """The request left the queues (finished, aborted or preempted): a read for it is not used."""
        self._reads.pop(req.request_id, None)

    def _fits(self, arrays: dict[str, np.ndarray]) -> bool:
        """Whether a file's arrays are one block of this pool's layout (the namespace should ensure it)."""
        kv = self.group.kv
        width = kv.dtype.size
        return (list(arrays) == self._names
                and all(a.shape == shape and a.dtype.itemsize == width
                        for a, shape in zip(arrays.values(), kv.shapes + kv.shapes)))

    def _install(self, req: Request, held: int, results: list) -> None:
        """Put the blocks read for ``req`` into the pool, cached, after the ``held`` blocks it found there."""
        group, pool, bs = self.group, self.group.pool, self.group.block_size
        if group.prefix_blocks(req, held) < held:
            return  # its prefix left the pool meanwhile: the blocks read would not continue it
        ram = group.prefix(req, held)
        pool.touch(ram)  # taking free blocks below must not evict the prefix they continue
        todo = []
        for h, arrays in zip(req.block_hashes[held:], results):
            if len(todo) == pool.num_free or not self._fits(arrays):
                break
            todo.append((h, arrays))
        blocks = group.take_blocks(len(todo))
        self.spill()  # the blocks just taken were someone's cached K/V: out before it is overwritten
        if blocks:
            ids = mx.array([b.block_id for b in blocks])
            kv = group.kv
            for i, name in enumerate(self._names):
                pools = kv.k if name[0] == "k" else kv.v
                layer = i % len(kv.k)
                data = mx.array(np.stack([a[name] for _, a in todo])).view(kv.dtype)
                pools[layer][ids] = data
            for b, (h, _) in zip(blocks, todo):
                pool.cache(b, h)
            self.store.totals.hit_blocks += len(blocks)
        pool.free(list(reversed(ram + blocks)))
