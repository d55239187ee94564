"""The prefix cache's disk tier: the main pool's cached blocks written out, and read back for requests.

Out: a cached block is copied to the host and queued for the disk store
(``disk_store``) when the pool evicts it (an allocation takes it, or the idle
pool is cut back), and, while no request holds a block, every cached block not
written yet is (so that a restart, or a crash after a pause, finds the blocks
of the last sessions). The copy is taken on the engine thread, before the step
that overwrites the block is built; the disk is written on the store's thread.
Blocks evicted faster than the disk takes them are dropped: the store bounds
what waits, in host memory, and writes the most recently evicted first,
dropping the least recently evicted (``DiskStore.write``). The pool evicts a
prefix's tail first, so what a writer that falls behind keeps is the heads of
the most recently used prefixes: a tail is no use without its head, a head
alone is a shorter hit. Of a batch of evicted blocks larger than the bound,
only the last evicted are copied (the rest would be dropped at once), so the
copy costs no more than the store takes. (Written in eviction order, oldest
first, an 8K-token session of an 8B model, 512 blocks of 2.3 MB evicted at
once on an H100, kept only its last ~108 blocks, and returning sessions found
297 of 8,256 tokens.)

In: before a waiting request is admitted, the blocks that continue its cached
prefix past what the pool holds are looked up in the store's index; if there
are any, they are read on the store's thread while the scheduler steps over
the request (it waits as it would for blocks being computed; other requests
run). Once read, they are put into free blocks of the pool and cached under
their hashes, and the request's lookup finds them like any cached prefix: its
``num_cached_tokens`` counts them. A block missing or not intact on disk ends
the run there: the rest is computed. A read not back within the read timeout
turns the tier off (the disk is not answering, and the store's readers
would hold every later read behind it): the request computes its prefix.
The blocks read are written into the pools and evaluated on the engine's
thread, after the step being encoded on another thread (``settle``): a step
graph must not hold an operation on this thread's stream, which the encode
thread cannot evaluate (MLX's streams are per thread).

Read or recompute: a read pays only where the disk gives the blocks back
faster than the engine computes them, which depends on the machine (a Mac's
prefill of a 30K context takes minutes; an H100 prefills 8K tokens of an 8B
model in 0.25 s, while the same 1.2 GB take longer than that to read). So the
tier measures both and decides per lookup: it reads the ``b`` bytes of the
``t`` tokens it would spare only if ``b / read_rate < t / prefill_rate``,
else the request computes its prefix (``DiskTotals.declined_reads``).
``prefill_rate`` is tokens per second of the requests that finished here,
each the prompt tokens it computed over its time from admission to its first
token (requests computing fewer than ``MIN_PREFILL_SAMPLE`` tokens are left
out: their time is a step's overhead); ``read_rate`` is bytes per second of
the reads the tier made, from asking to the blocks being in the pool. Both
are averages weighted by size, older samples fading (``Rate``). Until a read
was measured the store's write rate stands in for it (a disk rarely reads
slower than it writes); until either rate is known the tier reads. The rates
are kept in the namespace's folder (``disk_store.RATES_FILE``) at each idle
moment, so that a restarted engine decides from the first request on.

Each KV group is a part of the tier (``disk_parts``): the main pool's blocks, a
window pool's, a hybrid model's state snapshots, each written when it leaves
its own group. A prefix read back is the longest one every group can resume
from, with what it holds and what is on disk. Arrays following the pool (a
draft model's, an MTP layer's) have no disk copy: the engine builds no tier
beside them.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxd.engined.kv.disk_parts import UINT, Part
from mlxd.engined.kv.disk_store import DiskStore, gather
from mlxd.engined.kv.manager import extend_hashes
from mlxd.engined.request import Request

log = logging.getLogger("mlxd.engine")

# Bytes of K/V copied to the host at once.
CHUNK_BYTES = 32 * 2**20
# Requests computing fewer prompt tokens than this give no sample of the prefill rate.
MIN_PREFILL_SAMPLE = 512
# The weight an older sample of a rate keeps when a new one comes.
FADE = 0.5


class Rate:
    """Units per second over the samples given, each weighted by its size, older ones fading by ``FADE``."""

    def __init__(self, value: float | None = None):
        # A kept rate counts as one second's sample.
        self.units, self.seconds = (value, 1.0) if value else (0.0, 0.0)

    def add(self, units: float, seconds: float) -> None:
        if units > 0 and seconds > 0:
            self.units = self.units * FADE + units
            self.seconds = self.seconds * FADE + seconds

    @property
    def value(self) -> float | None:
        return self.units / self.seconds if self.units > 0 and self.seconds > 0 else None


def weights_fingerprint(model) -> str:
    """A digest of the model's parameters: each one's name, shape, dtype and 256 values spread over it.

    Reading every byte of a large model would add minutes to each start; a fine-tune or another
    quantization changes values throughout, so a sample tells checkpoints apart.
    """
    params = tree_flatten(model.parameters())
    samples = []
    for _, a in params:
        flat = a.reshape(-1)
        samples.append(flat[:: max(1, flat.size // 256)][:256].view(UINT[a.dtype.size]))
    mx.eval(samples)
    h = hashlib.blake2b(digest_size=16, person=b"mlxd-weights")
    for (name, a), sample in zip(params, samples):
        h.update(f"{name}:{a.shape}:{a.dtype}".encode())
        h.update(np.array(sample).tobytes())
    return h.hexdigest()


class DiskTier:
    def __init__(self, store: DiskStore, parts: list[Part], block_size: int, settle: Callable[[], None],
                 read_timeout: float):
        """``parts``: the main pool's first; ``settle``: waits for a step another thread is encoding
        (the arrays copied out may be its outputs); ``read_timeout``: seconds a request waits for a read
        before the disk is taken as not answering."""
        self.store = store
        self.parts = parts
        self.block_size = block_size
        self.settle = settle
        self.read_timeout = read_timeout
        # Per waiting request looked up: None (nothing to read, or read and put in place), or what is
        # being read: (prefix blocks, [(part, [block hashes])], future of their arrays, when it was asked).
        self._reads: dict[str, tuple[int, list[tuple[Part, list[bytes]]], Future, float] | None] = {}
        rates = store.rates
        self.prefill_rate = Rate(rates.get("prefill_tokens_per_s"))  # tokens/s of prompts computed
        self.read_rate = Rate(rates.get("read_bytes_per_s"))  # bytes/s of reads, asked to installed

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    # -- out --------------------------------------------------------------------------------------

    def spill(self) -> None:
        """Queue what left each group since the last call (contents intact) for writing, in the order
        they left it; of more than the store holds waiting, only the last (see the module doc)."""
        for part in self.parts:
            evicted = part.take_evicted()
            if evicted and self.store.enabled:
                fit = max(1, self.store.room() // max(1, part.entry_bytes))
                self.store.totals.dropped_writes += max(0, len(evicted) - fit)
                self._write(part, [(h, w) for h, w in evicted[-fit:] if not self.store.has(part.key(h))],
                            newest=True)

    def persist(self) -> None:
        """Queue everything the groups have cached that the store lacks (while no request holds a block),
        and keep the rates measured so far."""
        self.spill()  # and let go of what was evicted, whose copies may hold whole arrays
        for part in self.parts:
            if self.store.enabled:
                self._write(part, [(h, w) for h, w in part.cached() if not self.store.has(part.key(h))])
        rates = {"prefill_tokens_per_s": self.prefill_rate.value, "read_bytes_per_s": self.read_rate.value}
        self.store.save_rates({k: v for k, v in rates.items() if v})

    # -- read or recompute --------------------------------------------------------------------------

    def pays(self, nbytes: int, tokens: int) -> bool:
        """Whether reading ``nbytes`` is expected to take less time than computing the ``tokens`` they
        spare (see the module doc: measured rates; a read where they are not known yet)."""
        read = self.read_rate.value
        if read is None and self.store.write_seconds > 0:
            read = self.store.totals.bytes_written / self.store.write_seconds
        prefill = self.prefill_rate.value
        if read is None or prefill is None:
            return True
        return nbytes / read < tokens / prefill

    def _write(self, part: Part, entries: list, newest: bool = False) -> None:
        """Copy entries to the host and queue them, a bounded chunk at a time, while the store has room
        (a whole pool at once would need its size again in host memory); ``newest``: entries push
        older ones out of the store's queue instead (``DiskStore.write``)."""
        if not entries:
            return
        self.settle()
        step = max(1, CHUNK_BYTES // max(1, part.entry_bytes))
        for start in range(0, len(entries), step):
            if not newest and not self.store.has_room():
                self.store.totals.dropped_writes += len(entries) - start
                return
            chunk = entries[start:start + step]
            for (h, _), arrays in zip(chunk, part.host(chunk)):
                self.store.write(part.key(h), arrays)

    # -- in ---------------------------------------------------------------------------------------

    def reading(self, req: Request, held: Callable[[], int]) -> bool:
        """Whether ``req`` (waiting, nothing computed) waits for entries of a prefix longer than the
        ``held()`` blocks cached in memory being read."""
        rid = req.request_id
        if rid in self._reads:
            entry = self._reads[rid]
            if entry is None:
                return False
            n, wanted, future, asked = entry
            if not future.done():
                if self.store.enabled and time.monotonic() - asked < self.read_timeout:
                    return True
                # A disk that does not answer: the one worker would hold every later read behind it.
                self.store.turn_off(f"a read was not back in {self.read_timeout:g} s")
                self._reads[rid] = None
                return False
            self._reads[rid] = None
            if future.exception() is not None:  # a failure reading is a miss: the prefix is computed
                log.warning("KV disk cache: reading blocks failed: %r", future.exception())
            else:
                results = future.result()
                self._install(req, n, wanted, results)
                nbytes = sum(k * part.entry_bytes for (part, _), (k, _) in zip(wanted, results))
                self.read_rate.add(nbytes, time.monotonic() - asked)
            return False
        self._reads[rid] = None
        if not self.store.enabled:
            return False
        held = held()
        n = self._longest(req, held)
        hashes = req.block_hashes
        wanted = [(part, [hashes[i] for i in part.span(n, self.block_size) if not part.in_memory(hashes[i])])
                  for part in self.parts]
        wanted = [(part, hs) for part, hs in wanted if hs]
        if n <= held or not wanted:
            return False
        if not self.pays(sum(len(hs) * part.entry_bytes for part, hs in wanted), (n - held) * self.block_size):
            self.store.totals.declined_reads += 1
            return False
        future = gather([self.store.read([part.key(h) for h in hs], part.names, part.layout) for part, hs in wanted])
        self._reads[rid] = (n, wanted, future, time.monotonic())
        return True

    def _longest(self, req: Request, held: int) -> int:
        """The longest prefix (blocks) every part can give from memory or disk; ``held`` if none is longer."""
        bs = self.block_size
        n = (req.num_tokens - 1) // bs  # the last token is always computed (``cached_prefix``)
        extend_hashes(req, n, bs)
        hashes = req.block_hashes

        def has(part: Part, i: int) -> bool:
            return part.in_memory(hashes[i]) or self.store.has(part.key(hashes[i]))

        for part in self.parts:
            if part.prefix:  # needs every block: the first one missing bounds the prefix
                n = next((i for i in range(n) if not has(part, i)), n)
        others = [p for p in self.parts if not p.prefix]
        while n > held and not all(has(p, i) for p in others for i in p.span(n, bs)):
            n -= 1
        return n

    def futures(self) -> list[Future]:
        """The reads in progress (an idle engine waits on them)."""
        return [e[2] for e in self._reads.values() if e is not None and not e[2].done()]

    def forget(self, req: Request) -> None:
        """The request left the queues (finished, aborted or preempted): a read for it is not used; a
        finished one's prefill is a sample of the prefill rate."""
        self._reads.pop(req.request_id, None)
        computed = req.num_prompt_tokens - req.num_cached_tokens
        if (req.finished and computed >= MIN_PREFILL_SAMPLE and req.first_token_time is not None
                and req.first_scheduled_time is not None):
            self.prefill_rate.add(computed, req.first_token_time - req.first_scheduled_time)

    def _install(self, req: Request, n: int, wanted: list[tuple[Part, list[bytes]]], results: list) -> None:
        """Put what was read for ``req`` in place, part by part (the main pool's first); whatever is
        missing cuts the prefix its lookup then finds."""
        # The arrays written below are evaluated here, on this thread, each part's at the end of its
        # install: left lazy, they would enter the next step's graph as operations on this thread's
        # default stream, which the thread encoding steps (``fastpath/encode_thread``) cannot evaluate
        # ("There is no Stream(gpu, 0) in current thread", MLX's streams being per thread). Their
        # inputs are the pools as the step in flight leaves them: that step must be encoded first.
        self.settle()
        read = {part: (dict(zip(hs[:k], range(k))), arrays) for (part, hs), (k, arrays) in zip(wanted, results)}
        for i, part in enumerate(self.parts):
            hashes = [req.block_hashes[j] for j in part.span(n, self.block_size)]
            rows, arrays = read.get(part, ({}, {}))
            done = part.install(hashes, rows, arrays, self.spill) if rows else 0
            if i == 0:
                self.store.totals.hit_blocks += done
        self.spill()
