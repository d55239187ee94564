"""The engine daemon: one Engine, serving any number of gateways over a ZeroMQ ROUTER socket.

Two threads. The wire thread (``Wire``, the second half of this module) owns
the socket and answers what needs no engine (HELLO; PING while a step runs
long). The engine thread (``Daemon``) never waits on a gateway: between steps
it takes what the wire's inbox holds, runs the next step and queues the
outputs for the wire. A gateway that stops pinging is declared gone and its
requests are aborted, freeing their blocks.

An ABORT (a client left) must not wait behind the inbox: a step can take
minutes on a loaded machine, and a burst queues thousands of messages. The
wire thread notes the ids of each ABORT as it arrives; at the next point
between steps the engine thread aborts those it holds before it reads the
inbox, and never admits an ADD whose ABORT came, however far behind it sits.

The wire thread answers HELLO itself, and PING too while a step has run for
over a second (a 60 s prefill is not a dead engine), notes when each gateway
was last heard from, hands every other message to the engine thread's
``inbox`` in order (so a PING answered there reflects all that its gateway
sent before it), and forwards what the engine thread ``send``s (over an inproc
socket: ZeroMQ sockets are not shared between threads). Bad frames are logged
and dropped. A PONG carries what the engine holds when it is answered
(``Daemon.held``, read live from either thread), as the metrics' gauges do.

A gateway's send queue is bounded: a send past it fails at once (mandatory
routing) and the wire thread decides: a PONG is dropped, anything else (or
many PONGs) ends the gateway, which the engine thread learns as ``STALLED``.

Over 400 lines because the engine process's two threads and the inbox and outbox between them are
one protocol (what the wire thread answers itself, what it hands the engine thread), read in one place.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable

import msgspec
import zmq

from mlxd.engined.metrics import StatsLog
from mlxd.shared import protocol as p
from mlxd.shared.curve import secure_server
from mlxd.shared.errors import EngineUnavailableError, InvalidRequestError, MlxdError
from mlxd.shared.paths import check_ipc_endpoint, refuse_live_ipc
from mlxd.shared.protocol import Kind

log = logging.getLogger("mlxd.engine")

# How long the engine thread waits for a message when no request is running (s): bounds
# how late housekeeping (gateway timeouts, SIGTERM) is noticed when idle.
_IDLE_WAIT_S = 0.1
_HOUSEKEEPING_S = 0.5
# Seconds between the periodic stats lines (vLLM's line, at INFO while there is work).
_STATS_LOG_S = 5.0


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mlxd")
    except Exception:
        return "0"


class Daemon:
    """Owns the Engine and (through its wire thread) the ROUTER socket; ``run()`` returns the exit code."""

    def __init__(self, engine, endpoint: str, *, gateway_timeout: float = 10.0,
                 shutdown_timeout: float = 3.0, parent_pid: int | None = None,
                 curve_keys: str | None = None, log_stats: bool = True):
        self.engine = engine
        self.endpoint = endpoint
        self.gateway_timeout = gateway_timeout
        self.shutdown_timeout = shutdown_timeout
        self.parent_pid = parent_pid
        self.instance_id = uuid.uuid4().hex
        self.info = self._engine_info()
        # request id -> identity of the gateway that sent it (engine thread only)
        self.owner: dict[str, bytes] = {}
        self._stats_log = StatsLog(engine.metrics) if log_stats else None
        self.stop_reason: str | None = None
        # When the engine thread last looked for messages: silence is measured up to then, so the
        # step that just ran does not count against a gateway that sends nothing while it waits.
        self._drained_at = time.monotonic()
        self.step_seconds = 0.0
        self.io_seconds = 0.0
        self.num_steps = 0
        self._stop_deadline = 0.0
        self._stop_lock = threading.Lock()
        self.wire = Wire(endpoint, curve_keys, self.info, self.held)
        self.endpoint = self.wire.endpoint

    def _engine_info(self) -> p.EngineInfo:
        return p.EngineInfo(
            **{**msgspec.structs.asdict(self.engine.info), "lora_adapters": list(self.engine.info.lora_adapters)},
            protocol_version=p.PROTOCOL_VERSION,
            engine_version=_version(),
            instance_id=self.instance_id,
            pid=os.getpid(),
        )

    # -- signals -------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the engine (``request_stop``), counted from the signal's arrival.

        Python runs a signal handler in the main thread between bytecodes, so a signal that comes
        during a step (one MLX call, minutes long on a loaded machine) would be handled when the step
        ends, and the shutdown timeout would start only then. The signal's number written to a pipe
        (``signal.set_wakeup_fd``) wakes a thread of its own at once instead.
        """
        def on_signal(signum, _frame):
            self.request_stop(f"{signal.Signals(signum).name} received")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch_signals, args=(r,), name="signal-watch", daemon=True).start()

    def _watch_signals(self, fd: int) -> None:
        while data := os.read(fd, 64):
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self.request_stop(f"{signal.Signals(signum).name} received")

    def request_stop(self, reason: str) -> None:
        """Stop taking requests; running ones get ``shutdown_timeout`` to finish (from any thread; the
        first call decides).

        ``reason`` is the cause alone ("SIGTERM received"): gateways put it after "the engine
        stopped: ", clients after "the engine is shutting down: ".
        """
        with self._stop_lock:
            if self.stop_reason is not None:
                return
            # The deadline first: the engine thread reads it once it sees a reason.
            self._stop_deadline = time.monotonic() + self.shutdown_timeout
            self.stop_reason = reason
        n = len(self.owner)
        log.info("stopping (%s): %s", reason, f"{n} request(s) in flight get {self.shutdown_timeout:g}s to finish"
                 if n else "no request in flight")

    # -- the engine thread ---------------------------------------------------

    def run(self) -> int:
        log.info("engine serving %s on %s", self.info.served_model_name, self.endpoint)
        self.wire.publish(self._adapters())
        self.wire.start()
        next_housekeeping = time.monotonic() + _HOUSEKEEPING_S
        clock = time.perf_counter
        try:
            while True:
                if not self.wire.is_alive():
                    raise RuntimeError("the engine's wire thread stopped (see the log above)")
                busy = self.engine.has_unfinished()
                t0 = clock()
                self._drained_at = time.monotonic()
                self._drain(wait=0.0 if busy else _IDLE_WAIT_S)
                if self.engine.has_unfinished():
                    t1 = clock()
                    self.wire.step_started = time.monotonic()
                    outputs = self.engine.step()
                    self.wire.step_started = None
                    t2 = clock()
                    self._send_failures()
                    self._send_outputs(outputs)
                    self.step_seconds += t2 - t1
                    self.num_steps += 1
                    # Socket work around the step: what serving costs the engine.
                    self.io_seconds += (t1 - t0 if busy else 0.0) + clock() - t2
                now = time.monotonic()
                if now >= next_housekeeping:
                    next_housekeeping = now + _HOUSEKEEPING_S
                    self._housekeeping()
                    if self._stats_log is not None:
                        self._stats_log.maybe_log(now, self.engine.stats(), _STATS_LOG_S)
                if self.stop_reason is not None:
                    if not self.engine.has_unfinished() or now >= self._stop_deadline:
                        self._abort_all(EngineUnavailableError(f"the engine is shutting down: {self.stop_reason}"))
                        self._broadcast_dead(self.stop_reason)
                        return 0
        except Exception as e:  # the engine itself failed: tell every gateway, then exit
            log.error("engine failed:\n%s", traceback.format_exc())
            self._broadcast_dead(f"engine failed: {type(e).__name__}: {e}")
            return 1
        finally:
            self.wire.close()  # after the frames queued above (DEAD, the per-request errors) are sent

    def _drain(self, wait: float) -> None:
        """Act on what the wire thread handed over, waiting up to ``wait`` seconds for the first;
        the ABORTs it received first, ahead of whatever is queued before them."""
        wire = self.wire
        for identity, ids in wire.aborting().items():
            self._abort(identity, ids)
        inbox = wire.inbox
        for i in range(MAX_DRAIN):
            try:
                identity, kind, msg = inbox.get(timeout=wait) if i == 0 and wait else inbox.get_nowait()
            except queue.Empty:
                return
            if kind is Kind.ADD:
                wire.adds_taken += 1
            try:
                self._handle(identity, kind, msg)
            except Exception:
                # A message the engine could not act on must not take the engine down
                # unless the engine itself broke (that surfaces from step()).
                log.error("failed to handle %s from %s:\n%s", kind.name, identity.hex(),
                          traceback.format_exc())

    def _handle(self, identity: bytes, kind: Kind, msg) -> None:
        if kind is Kind.ADD:
            self._add(identity, msg)
        elif kind is Kind.ABORT:
            self.wire.aborted(identity, msg.request_ids)
            self._abort(identity, msg.request_ids)
        elif kind is Kind.PING:
            self._send(identity, Kind.PONG, self.wire.pong(msg.sent_at))
        elif kind is Kind.LORA:
            self._update_lora(identity, msg)
        elif kind is Kind.BYE:
            self._forget_gateway(identity, "said goodbye")
        elif kind == STALLED:
            self._forget_gateway(identity, f"stopped reading (over {SEND_HWM} messages queued for it)")

    def _abort(self, identity: bytes, request_ids: list[str]) -> None:
        """Stop those of ``request_ids`` that ``identity`` sent and the engine holds; the rest are
        finished, or not taken in yet (``_add`` skips those)."""
        ids = [r for r in request_ids if self.owner.get(r) == identity]
        for r in ids:
            del self.owner[r]
        if ids:
            self.engine.abort(ids)
            log.debug("gateway %s aborted %s", identity.hex(), ids)

    def _add(self, identity: bytes, msg: p.AddRequest) -> None:
        rid = msg.request_id
        if self.wire.is_aborting(identity, rid):
            self._skip(msg)
            return
        try:
            if self.stop_reason is not None:
                raise EngineUnavailableError(f"the engine is shutting down: {self.stop_reason}")
            if rid in self.owner:
                raise InvalidRequestError(f"request id {rid!r} is already in flight")
            self.engine.add_request(rid, msg.prompt_token_ids, msg.params, cache_salt=msg.cache_salt,
                                    app=msg.app, priority=msg.priority, group=msg.group,
                                    group_size=msg.group_size, params_n=msg.n if msg.choice == 0 else 0,
                                    task=msg.task, lora_name=msg.lora_name, images=msg.images,
                                    # only the speech engine takes audio (the gateway sends it no other)
                                    **({"audio": msg.audio} if msg.audio is not None else {}))
        except MlxdError as e:
            self._send_error(identity, rid, e)
            return
        except Exception as e:
            log.error("add_request(%s) failed:\n%s", rid, traceback.format_exc())
            self._send_error(identity, rid, InvalidRequestError(f"request refused: {e}"))
            return
        self.owner[rid] = identity

    def _skip(self, msg: p.AddRequest) -> None:
        """Never admit a request whose ABORT came before the engine took it in (its client left).

        The first member of a client request's group reserved a waiting place for each later one
        (``WaitingPlaces``); a member skipped here is counted off as admission would count it, or
        the reservation would outlive the group.
        """
        if msg.group is not None and msg.group_size > 1:
            try:
                self.engine.places.take(msg.group, msg.group_size, self.engine.stats().num_waiting)
            except MlxdError:
                pass  # the group was refused: nothing was reserved
        log.debug("request %s skipped: aborted before the engine took it in", msg.request_id)

    def _update_lora(self, identity: bytes, msg: p.LoraUpdate) -> None:
        """Load or unload an adapter between steps; the answer lists the adapters served after it."""
        try:
            if msg.action == "load" and msg.lora_path is not None:
                self.engine.load_lora(msg.lora_name, msg.lora_path)
            elif msg.action == "unload":
                self.engine.unload_lora(msg.lora_name)
            else:
                raise InvalidRequestError(f"unknown LoRA update {msg.action!r}")
        except MlxdError as e:
            self._send_error(identity, msg.op_id, e)
            return
        except Exception as e:
            log.error("LoRA %s of %s failed:\n%s", msg.action, msg.lora_name, traceback.format_exc())
            self._send_error(identity, msg.op_id, InvalidRequestError(f"LoRA {msg.action} failed: {e}"))
            return
        self.wire.publish(self._adapters())
        self._send(identity, Kind.LORA_DONE, p.LoraAdapters(op_id=msg.op_id, adapters=self._adapters()))

    def _adapters(self) -> list[p.LoraAdapter]:
        return list(self.engine.info.lora_adapters)

    def _send_failures(self) -> None:
        """Requests the engine failed after accepting them (a grammar that did not compile)."""
        for rid, err in self.engine.take_errors():
            identity = self.owner.pop(rid, None)
            if identity is not None:
                self._send_error(identity, rid, err)

    def _send_outputs(self, outputs) -> None:
        if not outputs:
            return
        by_gateway: dict[bytes, list] = defaultdict(list)
        owner = self.owner
        for out in outputs:
            identity = owner.get(out.request_id)
            if identity is None:
                continue  # aborted by its gateway in the meantime
            if out.finish_reason is not None:
                del owner[out.request_id]
            by_gateway[identity].append(out)
        for identity, outs in by_gateway.items():
            self._send(identity, Kind.OUTPUTS, p.StepOutputs(outs))

    def _send(self, identity: bytes, kind: Kind, payload) -> None:
        self.wire.send(identity, kind, payload)

    def _send_error(self, identity: bytes, request_id: str | None, e: MlxdError) -> None:
        self._send(identity, Kind.ERROR, p.Error(request_id=request_id, code=e.code,
                                                 message=e.message, param=e.param))

    def held(self) -> p.EngineStats:
        """What the engine holds now, from either thread (a PONG the wire thread answers during a long
        step says what that step runs, not what ran before it): the ADDs in the inbox count as waiting."""
        s = self.engine.stats()
        return p.EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting + self.wire.num_arriving(),
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
            num_preemptions=s.num_preemptions, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, step_seconds=self.step_seconds, io_seconds=self.io_seconds,
            num_steps=self.num_steps)

    # -- housekeeping --------------------------------------------------------

    def _housekeeping(self) -> None:
        for identity, quiet in self.wire.silent(self._drained_at, self.gateway_timeout):
            self._forget_gateway(identity, f"silent for {quiet:.1f}s")
        if self.parent_pid is not None and self.stop_reason is None and os.getppid() != self.parent_pid:
            self.request_stop("its parent process exited")
        self.engine.release_idle_memory()

    def _forget_gateway(self, identity: bytes, why: str) -> None:
        self.wire.forget(identity)
        ids = [r for r, g in self.owner.items() if g == identity]
        for r in ids:
            del self.owner[r]
        if ids:
            self.engine.abort(ids)
            # A gateway that is alive after all (stalled, not gone) learns why its streams ended.
            for rid in ids:
                self._send_error(identity, rid, EngineUnavailableError(
                    f"request aborted: the engine heard nothing from its gateway ({why})"))
        log.info("gateway %s %s; aborted %d request(s)", identity.hex(), why, len(ids))

    def _abort_all(self, e: MlxdError) -> None:
        ids = list(self.owner)
        if ids:
            self.engine.abort(ids)
        for rid in ids:
            self._send_error(self.owner.pop(rid), rid, e)

    def _broadcast_dead(self, reason: str) -> None:
        for identity in self.wire.gateways():
            self._send(identity, Kind.DEAD, p.Dead(reason=reason))


# The wire thread: the one owner of the ROUTER socket (see the module docstring).

# Messages handled per wake-up (frames read or forwarded here, inbox messages taken by the engine
# thread between steps), so that a flood cannot starve the rest.
MAX_DRAIN = 4096
# The wire thread's poll timeout (ms): how late it notices that it must stop.
_WIRE_POLL_MS = 100
# A step running this long (s) gets its PINGs answered by the wire thread (its stats read live).
_LONG_STEP_S = 1.0
# Messages queued for one gateway before sends to it fail: a gateway that stops reading
# (while it still writes, so it never looks silent) must not grow the engine without bound.
SEND_HWM = 1000
# PONGs dropped in a row (its queue full) after which a gateway counts as gone.
_MAX_DROPPED_PONGS = 100
# What the wire thread hands the engine thread for a gateway whose queue stayed full.
STALLED = "stalled"


class Wire:
    """The socket, bound at construction; ``start`` runs the thread, ``close`` ends it after every
    queued frame is on the wire. ``info`` (the READY answer) and ``instance_id`` are the engine's;
    ``held()`` is the stats a PONG carries (``Daemon.held``)."""

    def __init__(self, endpoint: str, curve_keys: str | None, info: p.EngineInfo,
                 held: Callable[[], p.EngineStats]):
        self.info = info
        self._held = held
        # gateway identity -> monotonic time it was last heard from (written here, read by the
        # engine thread's housekeeping); guarded with ``greeted`` by ``_lock``.
        self.last_seen: dict[bytes, float] = {}
        # Gateways whose connection was logged: a gateway repeats HELLO until it hears READY (a
        # queue of them when it waited for the engine to load), and one line says it.
        self._greeted: set[bytes] = set()
        self._lock = threading.Lock()
        # (identity, kind, message) from gateways, for the engine thread.
        self.inbox: queue.Queue = queue.Queue()
        # (gateway, request id) of each ABORT put in the inbox and not yet reached there by the
        # engine thread (guarded by ``_lock``): see the module docstring.
        self._aborting: set[tuple[bytes, str]] = set()
        # ADDs put in the inbox (counted here) and taken from it (counted by the engine thread):
        # the difference is held by the engine but not taken in yet, waiting as a client sees it.
        self.adds_received = 0
        self.adds_taken = 0
        # The adapters a PONG and READY carry: replaced whole by the engine thread (``publish``), read here.
        self._adapters: list[p.LoraAdapter] = []
        # When the running step began (monotonic; set by the engine thread), None between steps.
        self.step_started: float | None = None
        # This thread only: PONGs dropped in a row per gateway, and gateways reported stalled.
        self._dropped: dict[bytes, int] = {}
        self._stalled: set[bytes] = set()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 1000)
        # A socket directory others can write, or TCP beyond loopback without keys, is refused.
        check_ipc_endpoint(endpoint)
        self._auth = secure_server(self.ctx, self.sock, endpoint, curve_keys)
        refuse_live_ipc(endpoint)
        self.sock.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        # The engine thread's frames reach this thread through this pair, in order.
        outbox = f"inproc://mlxd-outbox-{info.instance_id}"
        self._outbox_in = self.ctx.socket(zmq.PULL)
        self._outbox_in.bind(outbox)
        self._outbox = self.ctx.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.connect(outbox)
        self._thread = threading.Thread(target=self._loop, name="engine-wire", daemon=True)

    # -- the engine thread's side -------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, identity: bytes, kind: Kind, payload) -> None:
        """Queue a frame for the wire thread (never blocks: the inproc pipe has no limit)."""
        self._outbox.send_multipart([identity, *p.encode(kind, payload)])

    def publish(self, adapters: list[p.LoraAdapter]) -> None:
        """The adapters the PONGs and READYs carry from now on."""
        self._adapters = adapters

    def aborting(self) -> dict[bytes, list[str]]:
        """The request ids of the ABORTs in the inbox, by gateway."""
        if not self._aborting:  # the common case, read without the lock
            return {}
        by_gateway: dict[bytes, list[str]] = defaultdict(list)
        with self._lock:
            for identity, rid in self._aborting:
                by_gateway[identity].append(rid)
        return by_gateway

    def is_aborting(self, identity: bytes, request_id: str) -> bool:
        if not self._aborting:
            return False
        with self._lock:
            return (identity, request_id) in self._aborting

    def aborted(self, identity: bytes, request_ids: list[str]) -> None:
        """The engine thread reached this ABORT in the inbox: every ADD before it has been seen."""
        with self._lock:
            self._aborting.difference_update((identity, r) for r in request_ids)

    def num_arriving(self) -> int:
        """ADDs in the inbox (from any thread: each count has one writer). The count taken is read
        first: the one received only grows and is never behind it, so the difference is never negative."""
        taken = self.adds_taken
        return self.adds_received - taken

    def pong(self, sent_at: float) -> p.Pong:
        return p.Pong(self.info.instance_id, sent_at, self._held(), self._adapters)

    def silent(self, at: float, timeout: float) -> list[tuple[bytes, float]]:
        """(gateway, seconds quiet) of the gateways not heard from for over ``timeout`` before ``at``."""
        with self._lock:
            return [(g, at - seen) for g, seen in self.last_seen.items() if at - seen > timeout]

    def gateways(self) -> list[bytes]:
        with self._lock:
            return list(self.last_seen)

    def forget(self, identity: bytes) -> None:
        with self._lock:
            self.last_seen.pop(identity, None)
            self._greeted.discard(identity)

    def close(self) -> None:
        """Stop after forwarding every frame queued before this call, then end the context.

        The wire thread forwards what is queued (DEAD, the per-request errors) before it closes
        the socket; terminating the context then waits (up to LINGER) until those last frames
        are on the wire. Exiting without both would drop them.
        """
        self._outbox.send_multipart([b""])  # the end marker, after every real frame
        self._thread.join()
        self._outbox.close(linger=0)  # the wire thread has read everything (or is gone)
        if self._auth is not None:
            self._auth.stop()  # its ZAP socket would keep ctx.term() waiting
        self.ctx.term()

    # -- the wire thread -----------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._outbox_in, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(_WIRE_POLL_MS))
                if self._outbox_in in ready and not self._forward_outbox():
                    return
                if self.sock in ready:
                    self._read_gateways()
        except Exception:
            log.error("the engine's wire thread failed:\n%s", traceback.format_exc())
        finally:
            self.sock.close()
            self._outbox_in.close()

    def _forward_outbox(self) -> bool:
        """Put the engine thread's frames on the socket; False at its end marker."""
        for _ in range(MAX_DRAIN):
            try:
                frames = self._outbox_in.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frames == [b""]:
                return False
            self._put(frames)
        return True

    def _put(self, frames: list[bytes]) -> None:
        """Send ``[identity, kind, payload]`` without blocking; a gateway whose queue is full loses it.

        A lost PONG only delays liveness, so PONGs are dropped up to a bound;
        a lost OUTPUTS or ERROR would leave a stream with a hole, so its
        gateway is reported stalled at once and the engine thread aborts its
        requests. The gateway's next successful send clears the count.
        """
        identity = frames[0]
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            dropped = self._dropped.get(identity, 0) + 1
            self._dropped[identity] = dropped
            if frames[1] != Kind.PONG.value or dropped >= _MAX_DROPPED_PONGS:
                if identity not in self._stalled:
                    self._stalled.add(identity)
                    log.warning("gateway %s does not read: dropped %d frame(s), the last a %s", identity.hex(),
                                dropped, Kind(frames[1]).name)
                    self.inbox.put((identity, STALLED, None))
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return  # that gateway has disconnected: nobody to tell
        if identity in self._dropped:
            del self._dropped[identity]
            self._stalled.discard(identity)

    def _read_gateways(self) -> None:
        for _ in range(MAX_DRAIN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) < 2:
                log.warning("dropped a frame without identity or kind")
                continue
            identity, body = frames[0], frames[1:]
            try:
                kind, msg = p.decode(body)
            except p.MalformedFrame as e:
                log.warning("dropped a malformed frame from gateway %s: %s", identity.hex(), e)
                continue
            with self._lock:
                self.last_seen[identity] = time.monotonic()
            started = self.step_started
            if kind is Kind.PING and started is not None and time.monotonic() - started > _LONG_STEP_S:
                self._reply(identity, Kind.PONG, self.pong(msg.sent_at))
            elif kind is Kind.HELLO:
                self._hello(identity, msg)
            elif kind in (Kind.ADD, Kind.ABORT, Kind.BYE, Kind.PING, Kind.LORA):
                # Counted before the engine thread can see it (so that it never counts more taken).
                if kind is Kind.ADD:
                    self.adds_received += 1
                elif kind is Kind.ABORT:
                    with self._lock:
                        self._aborting.update((identity, r) for r in msg.request_ids)
                self.inbox.put((identity, kind, msg))
            else:
                log.warning("dropped a %s frame: not a gateway's message", kind.name)

    def _reply(self, identity: bytes, kind: Kind, payload) -> None:
        self._put([identity, *p.encode(kind, payload)])

    def _hello(self, identity: bytes, msg: p.Hello) -> None:
        if msg.protocol_version != p.PROTOCOL_VERSION:
            self._reply(identity, Kind.ERROR, p.Error(
                request_id=None, code="protocol_mismatch",
                message=f"engine speaks protocol {p.PROTOCOL_VERSION}, gateway "
                        f"{msg.protocol_version}; upgrade the older one"))
            with self._lock:
                self.last_seen.pop(identity, None)
            return
        with self._lock:
            first = identity not in self._greeted
            self._greeted.add(identity)
        if first:
            log.info("gateway %s connected (pid %d)", identity.hex(), msg.pid)
        # The adapters served now, not those of the start: one may have been loaded since.
        self._reply(identity, Kind.READY, msgspec.structs.replace(self.info, lora_adapters=self._adapters))
