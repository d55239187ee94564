"""Pipeline and tensor parallelism over ``mx.distributed``: rank 0 runs the engine, the other ranks mirror it.

Each rank holds its part of the model (``model_split``: a run of layers, or a
shard of every layer) and the paged KV pool of that part only. Rank 0 owns
the scheduler, the block tables and the gateways' socket. Every call it makes
that changes its KV manager (create, allocate, commit, free, a step's slots)
is journaled, and once per forward the journal and the step's tokens go to
every other rank in one message. A worker replays the journal on its own KV
manager, which, fed the same calls over a pool of the same size, holds the same
block tables, and runs the same forward: the pipelined model passes hidden
states rank to rank with ``send``/``recv``, down to rank 0, which runs the last
layers and the head and samples.

Several batches in flight (vLLM's virtual engines): with one, the ranks take
turns and N-1 of N idle. The engine's scheduler has a lane per batch in flight
(``Scheduler.num_lanes``), each with its own requests; rank 0 sends a batch for
every lane with none out (``MirroredRunner.send``), then runs the oldest one's
last stage and reads its tokens, while the other ranks compute the batches
sent after it. Every rank runs the batches in the order they were sent, so the
KV each reads is written first on every rank.

The pool size is the smallest any rank affords (each sizes its own from its own
memory, for its own layers). A rank that dies makes the next step raise on rank
0 ("connection to a peer was lost"), which ends the engine; a rank that stops
answering is caught by ``Watchdog``. With nothing in flight rank 0 lets the
other ranks rest (``Link.rest``): they wait in the OS for its doorbell, since a
worker waiting in MLX's receive keeps a core busy (``engined.parallel.doorbell``).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import logging
import threading
import time
from collections import deque

import mlx.core as mx

from mlxd.engined import memory_guard
from mlxd.engined.device import device_kind
from mlxd.engined.kv.kinds import build_manager
from mlxd.engined.kv.manager import KVCacheManager
from mlxd.engined.memory_guard import MemoryPlan
from mlxd.engined.parallel import model_split
from mlxd.engined.parallel.rank_link import Link, Message, Op
from mlxd.engined.request import Request
from mlxd.engined.runner import ModelRunner, forward, forward_pooled
from mlxd.engined.scheduler import SchedulerOutput
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ModelLoadError
from mlxd.shared.protocol import SamplingParams

log = logging.getLogger("mlxd.engine")


@dataclasses.dataclass(frozen=True)
class Groups:
    """This process's view of its ranks: the link's group, and the one a tensor-parallel model sums over."""

    link: mx.distributed.Group  # rank 0's journal and the pipeline's hand-offs: send and receive
    tensor: mx.distributed.Group  # NCCL's where the ranks have it, else ``link``


def join(config: EngineConfig) -> Groups:
    """This process's groups of ``config.num_ranks`` ranks (the launcher set MLX_RANK and MLX_HOSTFILE).

    Waiting for the other ranks to connect holds the interpreter: a rank that never comes (it
    failed to start) is caught by the watchdog's C timer, not by any Python thread. The ring
    backend gives up connecting to a rank still loading after about 30 s; that is tried again
    for the first half of the timeout (the error then says why, before the watchdog must).

    On CUDA, where the launcher also gave NCCL's rendezvous (``mlxd.ranks`` does when each rank
    has its own GPU), a tensor-parallel model sums over NCCL, on the GPUs, where the ring would
    copy each sum through the host and a socket. NCCL cannot send to one rank, so the link is
    the ring's there, even where MLX would pick NCCL for its default group.
    """
    size = config.num_ranks
    nccl = mx.distributed.is_available("nccl")
    deadline = time.monotonic() + config.pipeline_timeout / 2
    try:
        with Watchdog(config.pipeline_timeout):
            while True:
                try:
                    link = mx.distributed.init(strict=True, backend="ring" if nccl else "any")
                    break
                except RuntimeError as e:
                    if "Couldn't connect" not in str(e) or time.monotonic() > deadline:
                        raise
                    log.info("pipeline: a rank is not listening yet (%s); trying again", e)
    except RuntimeError as e:
        raise ModelLoadError(f"{size} ranks asked for, but no distributed backend came up ({e}); start the "
                             "ranks with mlx.launch or let `mlxd engine` start them on this machine") from e
    if link.size() != size:
        raise ModelLoadError(f"{size} ranks asked for (--pipeline/--tensor-parallel-size), but {link.size()} "
                             "were launched")
    if nccl and config.tensor_parallel_size > 1:
        try:
            tensor = mx.distributed.init(backend="nccl")  # a group of one where no rendezvous was given
        except RuntimeError as e:
            raise ModelLoadError(f"the ranks' ring came up but NCCL did not ({e})") from e
        if tensor.size() == size:
            return Groups(link, tensor)
    return Groups(link, link)


class JournaledKV:
    """Rank 0's KV manager: every call that changes it is recorded for the other ranks to replay."""

    def __init__(self, kv: KVCacheManager, link: Link):
        self._kv = kv
        self._link = link
        self._ops: list[Op] = []
        self._sent: dict[str, int] = {}  # per request, how many of its token ids the workers have

    def __getattr__(self, name):
        return getattr(self._kv, name)

    def _note(self, kind: str, req: Request | None = None, count: int = 0, blocks: list[int] = ()) -> None:
        if req is None:
            self._ops.append(Op(kind, count=count, blocks=list(blocks)))
            return
        rid = req.request_id
        sent = self._sent.get(rid)
        self._sent[rid] = req.num_tokens
        self._ops.append(Op(kind, rid, req.num_computed_tokens, req.num_tokens, count, list(blocks),
                            req.token_ids[sent or 0:], req.cache_salt if sent is None else None))

    def take(self, **fields) -> Message:
        """The journal so far as a message (with ``fields``), and a fresh journal."""
        message = Message(self._ops, **fields)
        self._ops = []
        return message

    def flush(self) -> None:
        """Send what is journaled now (a shrink while idle must not wait for the next request)."""
        self._link.send(self.take())

    # -- the calls that change the manager -----------------------------------------------------

    def create(self, num_blocks: int, resident: int | None = None) -> None:
        self._note("create", count=num_blocks, blocks=[] if resident is None else [resident])
        self._kv.create(num_blocks, resident)

    def cached_prefix(self, req: Request):
        self._note("prefix", req)  # it grows the request's block hashes, which later calls read
        return self._kv.cached_prefix(req)

    def allocate(self, req: Request, num_new_tokens: int, prefix=()) -> bool:
        prefix = list(prefix)
        if not self._kv.allocate(req, num_new_tokens, prefix):
            return False  # a refused allocation changes nothing
        self._note("allocate", req, num_new_tokens, [b.block_id for b in prefix])
        return True

    def commit(self, req: Request) -> None:
        self._note("commit", req)
        self._kv.commit(req)

    def free(self, req: Request) -> None:
        self._note("free", req)
        self._sent.pop(req.request_id, None)  # a preempted request is sent whole again when it returns
        self._kv.free(req)

    def step_caches(self, scheduled: list[tuple[Request, int]]) -> list:
        for req, n in scheduled:
            self._note("sched", req, n)
        self._note("step")
        return self._kv.step_caches(scheduled)

    def release_idle(self, now: float) -> bool:
        """As the manager's (the daemon's housekeeping calls it), and with no request holding a block,
        nothing is in flight: the other ranks rest until the next message."""
        released = self._kv.release_idle(now)
        if released:
            self._note("shrink")
        if not self._kv.main.tables and self._link.can_rest:
            self._link.rest(self.take(query="rest"))
        elif released:
            self.flush()
        return released

    def follow(self, arrays) -> None:
        # A draft model runs on rank 0 alone: its K/V follow this rank's pool, the others have none.
        self._kv.follow(arrays)


class Mirror:
    """A worker rank's copy of rank 0's KV manager, kept equal by replaying its journal."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self._tokens: dict[str, list[int]] = {}  # per request, every token id rank 0 sent
        self._scheduled: list[tuple[Request, int]] = []
        self.caches: list | None = None  # the last step's per-layer objects

    def _request(self, op: Op) -> Request:
        if op.salt is not None:  # rank 0 has not told of this request before (or since its free)
            self.requests[op.rid] = Request(op.rid, [], SamplingParams(), 0, op.salt)
            self._tokens[op.rid] = []
        req = self.requests[op.rid]
        self._tokens[op.rid] += op.tokens
        # Each call carries the ids rank 0 had not sent yet, so the list is the request's token ids
        # as they were when the call was made (calls read their length): no copy per call.
        req.token_ids = self._tokens[op.rid]
        assert len(req.token_ids) == op.num_tokens, "pipeline rank out of step with rank 0"
        req.num_computed_tokens = op.computed
        return req

    def apply(self, message: Message) -> None:
        for op in message.ops:
            self._replay(op)

    def _replay(self, op: Op) -> None:
        kv, kind = self.kv, op.kind
        if kind == "create":
            kv.create(op.count, op.blocks[0] if op.blocks else None)
        elif kind == "shrink":
            kv.main.shrink()
            mx.clear_cache()
        elif kind == "step":
            self.caches, self._scheduled = kv.step_caches(self._scheduled), []
        else:
            req = self._request(op)
            if kind == "prefix":
                kv.cached_prefix(req)
            elif kind == "allocate":
                if not kv.allocate(req, op.count, [kv.pool.blocks[i] for i in op.blocks]):
                    raise RuntimeError(f"pipeline rank out of step with rank 0: allocation for {op.rid} refused")
            elif kind == "commit":
                kv.commit(req)
            elif kind == "sched":
                self._scheduled.append((req, op.count))
            elif kind == "free":
                kv.free(req)
                del self.requests[op.rid], self._tokens[op.rid]


@dataclasses.dataclass
class SentBatch:
    """A batch out to the other ranks: what rank 0's part of it runs on (made when it was sent)."""

    batch: SchedulerOutput
    lane: int
    pieces: list[list[int]]
    caches: list
    num_logits: list[int]
    hidden_rows: list[int]


class MirroredRunner(ModelRunner):
    """Rank 0's runner: each forward first sends the journal and the step's tokens to the other ranks."""

    def __init__(self, model, specs, kv: KVCacheManager, attention_backend: str, config: EngineConfig):
        super().__init__(model, specs, kv, attention_backend)
        group = join(config).link
        model_split.hand_off(model, group)
        self.link = Link(group)
        # The other ranks may still be loading; the warm-up forward, which is watched, must not wait on that.
        self.link.connect(config.pipeline_timeout)
        self.kv = JournaledKV(kv, self.link)
        self.watchdog = Watchdog(config.pipeline_timeout)
        log.info("%d ranks: a step that waits over %gs on them stops the engine (--pipeline-timeout)",
                 config.num_ranks, config.pipeline_timeout)
        self.own_blocks = 0  # the pool this rank alone affords (``agree``)
        self.sent: deque[SentBatch] = deque()  # batches the other ranks have, oldest first
        self.num_overlapped = 0  # rank 0's parts run while a later batch was out (the others busy)

    def send(self, batch: SchedulerOutput, lane: int = 0, num_logits: list[int] | None = None) -> None:
        """Send ``batch`` (with the journal so far) to the other ranks, which compute their layers of
        it once they are done with the batches sent before; ``run_pooled`` runs rank 0's part."""
        pieces = self.pieces(batch)
        caches = self.kv.step_caches(batch.scheduled)
        num_logits = batch.num_logits if num_logits is None else num_logits
        with self.watchdog:
            self.link.send(self.kv.take(pieces=pieces, num_logits=num_logits))
        self.sent.append(SentBatch(batch, lane, pieces, caches, num_logits, batch.hidden_rows))

    def run_pooled(self, batch: SchedulerOutput, num_logits: list[int] | None = None
                   ) -> tuple[mx.array, mx.array | None]:
        """As ``ModelRunner.run_pooled`` for the oldest batch sent (a batch not sent yet is sent
        first), evaluated here: a rank that stops answering hangs it."""
        if not self.sent or self.sent[0].batch is not batch:
            assert not self.sent, "pipeline batches run out of the order they were sent in"
            self.send(batch, num_logits=num_logits)
        s = self.sent.popleft()
        self.num_overlapped += bool(self.sent)
        # Watched: the forward waits for the hidden states of the rank after this one.
        with self.watchdog:
            logits, hidden = forward_pooled(self.model, self.head, s.pieces, s.caches, s.num_logits, s.hidden_rows)
            mx.eval(logits, hidden if hidden is not None else [], self.kv.arrays())
        return logits, hidden

    def agree(self, plan: MemoryPlan) -> MemoryPlan:
        """``plan`` with the smallest pool any rank affords (each sizes its own, for its own layers)."""
        self.link.send(self.kv.take(query="blocks"))
        self.own_blocks = plan.num_blocks
        smallest = self.link.smallest(plan.num_blocks)
        if smallest == plan.num_blocks:
            return plan
        log.info("pipeline: the KV pool is %d blocks, the most every rank affords (this one: %d)",
                 smallest, plan.num_blocks)
        return dataclasses.replace(plan, num_blocks=smallest, kv_bytes=plan.kv_bytes * smallest // plan.num_blocks,
                                   initial_blocks=min(plan.initial_blocks, smallest))


def serve_worker(config: EngineConfig, groups: Groups, joined: threading.Event) -> int:
    """A rank other than 0: load this rank's layers, then replay rank 0's messages until it is gone;
    ``joined`` is set once the group is whole (rank 0's going away then ends this rank)."""
    from mlxd.engined.loaders import load_model
    from mlxd.engined.model_layers import float_dtype, read_layers
    from mlxd.engined import kernels

    config = config.for_device(device_kind())  # the same batch limits as rank 0's engine
    loaded = load_model(config.model, config.dtype)
    model_split.prepare(loaded.model, groups, config)
    group = groups.link
    specs = read_layers(loaded.model)
    kv = build_manager(specs, config, float_dtype(loaded.model))
    runner = ModelRunner(loaded.model, specs, kv, kernels.resolve_backend(config.attention_backend))
    model_split.hand_off(loaded.model, group)
    mirror, link = Mirror(kv), Link(group)
    pipelined = config.pipeline_parallel_size > 1
    link.connect(config.pipeline_timeout)  # loaded: rank 0's warm-up forward comes next
    joined.set()
    max_model_len = config.max_model_len or loaded.context_length
    gc.collect()
    weights = mx.get_active_memory()
    mx.reset_peak_memory()
    while True:
        try:
            message = link.receive()
        except RuntimeError as e:  # rank 0 stopped, or a link broke: the group is over
            log.info("pipeline rank %d: rank 0 is gone (%s); stopping", group.rank(), e)
            return 0
        mirror.apply(message)
        if message.query == "rest":
            log.debug("pipeline rank %d: resting until rank 0 has work", group.rank())
            if not link.wait():
                log.info("pipeline rank %d: rank 0 closed the wake connection; stopping", group.rank())
                return 0
        if message.pieces is not None:
            logits = forward(runner.model, runner.head, message.pieces, mirror.caches, message.num_logits)
            # A pipeline rank's part ends with its send, and it goes on to the next batch at once;
            # tensor-parallel ranks compute the whole step together.
            mx.eval(model_split.sent(runner.model) if pipelined else logits, kv.arrays())
        if message.query == "blocks":
            # The warm-up forward rank 0 ran has passed through here: its peak is this rank's scratch.
            activations = max(mx.get_peak_memory() - weights, 0)
            if config.num_kv_blocks is None:  # rank 0 ran no warm-up forward for a pool given in blocks
                mx.set_cache_limit(activations)
            plan = memory_guard.size_pool(weights, activations, [kv], config, max_model_len)
            log.info("pipeline rank %d: %s", group.rank(), plan.describe())
            link.smallest(plan.num_blocks)


class Watchdog:
    """Ends rank 0's process when a forward has waited past ``timeout`` seconds on the other ranks.

    A rank that stops answering (a stopped process, a cut link) would otherwise hang the engine in
    an evaluation that holds the interpreter, so no Python thread could notice: faulthandler's
    timer runs in C, prints every thread's stack and exits, and the supervisor restarts all ranks.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout

    def __enter__(self) -> None:
        faulthandler.dump_traceback_later(self.timeout, exit=True)

    def __exit__(self, *exc) -> None:
        faulthandler.cancel_dump_traceback_later()
