"""Block files on disk: the prefix cache's second tier, one checksummed file per cached block.

A block's file is named by its chained hash (``manager.hash_block``, which already covers the tokens
before it, the cache salt and so the LoRA adapter), with a suffix for the groups beside the main pool
(``disk_parts``), inside a namespace folder named by a digest of everything else that changes a block's
content: the weights' fingerprint, the KV dtype, the block size and the layout of every group. Engines of
different models can share the root; each keeps to its own namespace and budget.

One file per block, not per run of blocks: the key of a block is already its whole prefix, so sessions that
share a system prompt share its files, the LRU drops exactly one block's worth at a time, and a torn file
costs one block.

A file's format is ``disk_format``'s. Files are written to a temporary name and renamed, mode 0600 in 0700
folders.

Writes run on one worker thread (``_Worker``), newest first: of the blocks waiting, the one queued last is
written first, and past ``MAX_PENDING_BYTES`` waiting the one queued first is dropped. The tier queues blocks
in the order the pool evicted them, a prefix's tail first and the least recently used prefix first, so a
writer that falls behind keeps the heads of the most recently used prefixes (a tail is no use without its
head). Reads run on ``READ_THREADS`` others, so that a read never waits behind the writes queued before it
(the evictions of the request before); a read of many blocks is split among them (the checksum and the copies
release Python's lock) and lands in one array per name, stacked over the blocks (``read``), which the tier
copies into the pool at once. The index (hash -> bytes, least recently used first) is rebuilt from the folder
at start, oldest modification first, and a read touches a file so that the order survives a restart. Any
OSError on writing (disk full, folder gone or unwritable) is logged once and turns the tier off; serving goes
on without it. A process that exits lets the writes queued before it finish, for at most ``EXIT_WAIT_S`` and
only while the tier is on: a disk that never answers (a read given up by ``disk_tier``) does not keep the
engine from exiting.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import string
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from mlxd.engined.kv.disk_format import encode, layout_dtype, namespace, read_into
from mlxd.shared.paths import UnsafeDirectoryError, check_private_dir

log = logging.getLogger("mlxd.engine")

# Blocks evicted faster than the disk takes them are dropped past this many bytes waiting (the tier is a
# cache: a dropped block is recomputed later, memory is not): those evicted longest ago (``write``).
MAX_PENDING_BYTES = 256 * 2**20
# Temporary files older than this are an interrupted write's leftovers (another engine's write in progress
# is far younger).
STALE_TMP_S = 600.0
# The longest an exiting process waits for the writes still queued.
EXIT_WAIT_S = 30.0
# Threads reading the blocks of one request's prefix at once.
READ_THREADS = max(1, min(4, os.cpu_count() or 1))
# The rates the tier measured (``disk_tier``), kept beside the blocks for the next engine of this namespace.
RATES_FILE = "rates.json"


@dataclass
class DiskTotals:
    """Since the engine started: what the tier served, wrote and dropped; and what it holds now."""

    hit_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evicted_blocks: int = 0
    discarded_files: int = 0  # torn, truncated or foreign files found and deleted
    dropped_writes: int = 0  # blocks not written: too many waiting, or the tier off
    declined_reads: int = 0  # lookups that found blocks on disk but recomputed them (``disk_tier``: slower)
    blocks: int = 0
    bytes: int = 0


class DiskStore:
    def __init__(self, root: str, identity: dict, budget: int):
        """The namespace of ``identity`` under ``root`` (created 0700), holding at most ``budget`` bytes.
        An unusable folder leaves the store off (``enabled`` False), logged."""
        self.ns = namespace(identity)
        self.budget = budget
        self.totals = DiskTotals()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # block hash -> file bytes, LRU first
        self._lock = threading.Lock()
        self._pending = 0  # bytes handed to the worker, not written yet
        self.write_seconds = 0.0  # the writer's time on the bytes written (``totals.bytes_written``)
        self._queued: set[bytes] = set()  # their keys, and the key being written
        # Blocks waiting, queued first at the front: key -> (arrays, bytes).
        self._waiting: OrderedDict[bytes, tuple[dict[str, np.ndarray], int]] = OrderedDict()
        self._worker = _Worker()
        self._readers = [_Worker("kv-disk-read") for _ in range(READ_THREADS)]
        self.rates: dict[str, float] = {}  # the tier's measured rates, as the last engine left them
        atexit.register(self._exit)
        self.enabled = True
        self.path = os.path.join(root, self.ns)
        try:
            check_private_dir(root)
            check_private_dir(self.path)
            with open(os.path.join(self.path, "identity.json"), "w", opener=_private) as f:
                json.dump(identity, f, sort_keys=True)
            self._scan()
            self._load_rates()
        except (OSError, UnsafeDirectoryError) as e:
            self.turn_off(f"cannot use {self.path}: {e}")

    def _scan(self) -> None:
        """Rebuild the index from the folder, least recently used first, and hold it to the budget."""
        found, now = [], time.time()
        for entry in os.scandir(self.path):
            name = entry.name
            try:
                if name.startswith(".tmp-"):
                    if now - entry.stat().st_mtime > STALE_TMP_S:
                        _unlink(entry.path)
                    continue
                if len(name) not in (32, 34) or name.strip(string.hexdigits):  # a block hash, and a part's suffix
                    continue
                st = entry.stat()
            except FileNotFoundError:  # another engine of this namespace renamed or dropped it meanwhile
                continue
            found.append((st.st_mtime, bytes.fromhex(name), st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.totals.bytes += size
        self.totals.blocks = len(self.index)
        self._fit(0)
        log.info("KV disk cache: %s, %d blocks (%.1f MiB) found, budget %.1f GiB", self.path, len(self.index),
                 self.totals.bytes / 2**20, self.budget / 2**30)

    def _load_rates(self) -> None:
        try:
            with open(os.path.join(self.path, RATES_FILE)) as f:
                rates = json.load(f)
            self.rates = {k: float(v) for k, v in rates.items() if isinstance(v, (int, float)) and v > 0}
        except (OSError, ValueError, AttributeError):
            self.rates = {}

    def save_rates(self, rates: dict[str, float]) -> None:
        """Keep ``rates`` for the next engine of this namespace (written and renamed; errors ignored)."""
        self.rates = dict(rates)
        if not self.enabled:
            return
        tmp = os.path.join(self.path, f".tmp-rates-{threading.get_ident()}")
        try:
            with open(tmp, "w", opener=_private) as f:
                json.dump(rates, f, sort_keys=True)
            os.replace(tmp, os.path.join(self.path, RATES_FILE))
        except OSError:
            _unlink(tmp)

    def turn_off(self, why: str) -> None:
        if self.enabled:
            log.warning("KV disk cache off: %s; serving goes on without it", why)
        self.enabled = False

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex())

    def has(self, key: bytes) -> bool:
        return self.enabled and key in self.index

    def _fit(self, incoming: int) -> None:
        """Delete least recently used files until ``incoming`` more bytes fit the budget (lock held)."""
        while self.index and self.totals.bytes + incoming > self.budget:
            key, size = self.index.popitem(last=False)
            self.totals.bytes -= size
            self.totals.evicted_blocks += 1
            _unlink(self._file(key))
        self.totals.blocks = len(self.index)

    # -- writes -----------------------------------------------------------------------------------

    def has_room(self) -> bool:
        """Whether writes queued now would be taken (the tier is on, the queue below its bound)."""
        return self.enabled and self._pending < MAX_PENDING_BYTES

    def room(self) -> int:
        """Bytes that may wait to be written (blocks queued past it push the oldest waiting out)."""
        return MAX_PENDING_BYTES

    def write(self, key: bytes, arrays: dict[str, np.ndarray]) -> None:
        """Queue one block's arrays (host copies the caller no longer changes) for writing, before every
        block queued earlier; blocks queued earlier are dropped for it, oldest first, past the bound."""
        size = sum(a.nbytes for a in arrays.values())
        with self._lock:
            if key in self.index or key in self._queued:
                return
            while self._waiting and self._pending + size > MAX_PENDING_BYTES:
                old, (_, old_size) = self._waiting.popitem(last=False)
                self._pending -= old_size
                self._queued.discard(old)
                self.totals.dropped_writes += 1
            if not self.enabled or self._pending + size > MAX_PENDING_BYTES:
                self.totals.dropped_writes += 1
                return
            self._pending += size
            self._queued.add(key)
            self._waiting[key] = (arrays, size)
        self._worker.submit(self._write_newest)  # one call per block queued: each writes one, or none

    def _write_newest(self) -> None:
        with self._lock:
            if not self._waiting:
                return  # its block was dropped
            key, (arrays, size) = self._waiting.popitem(last=True)
        self._write(key, arrays, size)

    def _write(self, key: bytes, arrays: dict[str, np.ndarray], size: int) -> None:
        start = time.perf_counter()
        try:
            data = encode(self.ns, key, arrays)
            length = sum(map(len, data))  # byte views: len is bytes
            with self._lock:
                if not self.enabled:
                    return
                self._fit(length)
            tmp = os.path.join(self.path, f".tmp-{key.hex()}-{threading.get_ident()}")
            try:
                with open(tmp, "wb", opener=_private) as f:
                    f.writelines(data)
                os.replace(tmp, self._file(key))
            except OSError as e:
                _unlink(tmp)
                with self._lock:
                    self.turn_off(f"writing {self.path} failed: {e}")
                return
            with self._lock:
                old = self.index.pop(key, 0)
                self.index[key] = length
                self.totals.bytes += length - old
                self.totals.bytes_written += length
                self.totals.blocks = len(self.index)
                self.write_seconds += time.perf_counter() - start
        finally:
            with self._lock:
                self._pending -= size
                self._queued.discard(key)

    # -- reads ------------------------------------------------------------------------------------

    def read(self, keys: list[bytes], names: list[str], layout: list[tuple[tuple, int]]) -> Future:
        """A future of ``(n, arrays)``: ``arrays`` one array per name of ``names``, stacked over ``keys``
        (``layout``: each name's shape and element width), of which the leading ``n`` blocks were read
        whole; the first missing or damaged file (deleted) ends them. The reading is split among the
        read threads, each a run of the keys."""
        out = [np.empty((len(keys), *shape), layout_dtype(width)) for shape, width in layout]
        arrays = dict(zip(names, out))
        per = -(-len(keys) // len(self._readers)) if keys else 1
        runs = [(i, keys[i:i + per]) for i in range(0, len(keys), per)]
        reads = gather([worker.submit(self._read, run, first, names, out)
                        for worker, (first, run) in zip(self._readers, runs)])
        result: Future = Future()

        def done(f: Future) -> None:
            if f.exception() is not None:
                result.set_exception(f.exception())
                return
            # The first run cut short cuts the rest.
            ends = [end for end, run_end in f.result() if end < run_end]
            result.set_result((min(ends, default=len(keys)), arrays))

        reads.add_done_callback(done)
        return result

    def _read(self, keys: list[bytes], first: int, names: list[str], out: list[np.ndarray]) -> tuple[int, int]:
        """Read ``keys`` into rows ``first``, ``first + 1``, ... of ``out``: (the row after the last read
        whole, the row after the last of ``keys``)."""
        for j, key in enumerate(keys, first):
            path = self._file(key)
            try:
                with open(path, "rb") as f:
                    length = read_into(f, self.ns, key, names, [a[j] for a in out])
                found = True
            except OSError:
                length, found = None, False
            with self._lock:
                if length is None:
                    size = self.index.pop(key, None)
                    if size is not None:
                        self.totals.bytes -= size
                        self.totals.blocks = len(self.index)
                        self.totals.discarded_files += found
                        _unlink(path)
                else:
                    if key in self.index:
                        self.index.move_to_end(key)
                    self.totals.bytes_read += length
            if length is None:
                return j, first + len(keys)  # the blocks after it would not continue a prefix
            _touch(path)
        return first + len(keys), first + len(keys)

    def flush(self) -> None:
        """Wait for the writes queued so far (tests, shutdown)."""
        self._worker.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the writes queued so far and end the workers."""
        atexit.unregister(self._exit)
        self._worker.close(None)
        for reader in self._readers:
            reader.close(0.0)

    def _exit(self) -> None:
        self._worker.close(EXIT_WAIT_S if self.enabled else 0.0)


def gather(futures: list[Future]) -> Future:
    """A future of the results of ``futures`` (in order), or of the first exception among them."""
    out: Future = Future()
    lock, left = threading.Lock(), [len(futures)]

    def done(f: Future) -> None:
        with lock:
            if out.done():
                return
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            left[0] -= 1
            if left[0] == 0:
                out.set_result([g.result() for g in futures])

    if not futures:
        out.set_result([])
    for f in futures:
        f.add_done_callback(done)
    return out


class _Worker:
    """One thread running the calls given to it in order, each answered through a Future.

    A daemon thread, unlike ThreadPoolExecutor's, which the interpreter joins at exit however long
    they take: a call stuck on a disk that never answers would keep the process from ever exiting.
    """

    def __init__(self, name: str = "kv-disk"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> Future:
        future = Future()
        self._calls.put((future, fn, args))
        return future

    def close(self, timeout: float | None) -> None:
        """Let the calls queued so far run, waiting up to ``timeout`` seconds (None: as long as they take)."""
        self._calls.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the caller's to see, as an executor's future would carry it
                    future.set_exception(e)


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
