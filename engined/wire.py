"""The engine daemon's wire thread: the one owner of the ZeroMQ ROUTER socket that gateways talk to.

It answers HELLO itself, and PING too while a step has run for over a second
(a 60 s prefill is not a dead engine), notes when each gateway was last heard
from, hands every other message to the engine thread's ``inbox`` in order (so
a PING answered there reflects all that its gateway sent before it), and
forwards what the engine thread ``send``s (over an inproc socket: ZeroMQ
sockets are not shared between threads). Bad frames are logged and dropped.

A gateway's send queue is bounded: a send past it fails at once (mandatory
routing) and this thread decides: a PONG is dropped, anything else (or many
PONGs) ends the gateway, which the engine thread learns as ``STALLED``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback

import msgspec
import zmq

from shared import protocol as p
from shared.curve import secure_server
from shared.paths import check_ipc_endpoint, refuse_live_ipc
from shared.protocol import Kind

log = logging.getLogger("mlxd.engine")

# Messages handled per wake-up (frames read or forwarded here, inbox messages taken by the engine
# thread between steps), so that a flood cannot starve the rest.
MAX_DRAIN = 4096
# The wire thread's poll timeout (ms): how late it notices that it must stop.
_WIRE_POLL_MS = 100
# A step running this long (s) gets its PINGs answered by the wire thread, from the last stats.
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
    queued frame is on the wire. ``info`` (the READY answer) and ``instance_id`` are the engine's."""

    def __init__(self, endpoint: str, curve_keys: str | None, info: p.EngineInfo):
        self.info = info
        # gateway identity -> monotonic time it was last heard from (written here, read by the
        # engine thread's housekeeping); guarded with ``greeted`` by ``_lock``.
        self.last_seen: dict[bytes, float] = {}
        # Gateways whose connection was logged: a gateway repeats HELLO until it hears READY (a
        # queue of them when it waited for the engine to load), and one line says it.
        self._greeted: set[bytes] = set()
        self._lock = threading.Lock()
        # (identity, kind, message) from gateways, for the engine thread.
        self.inbox: queue.Queue = queue.Queue()
        # What a PONG carries: replaced whole by the engine thread (``publish``), read here.
        self._stats = p.EngineStats()
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

    def publish(self, stats: p.EngineStats, adapters: list[p.LoraAdapter]) -> None:
        """What the PONGs this thread answers carry from now on."""
        self._stats, self._adapters = stats, adapters

    def pong(self, sent_at: float) -> p.Pong:
        return p.Pong(self.info.instance_id, sent_at, self._stats, self._adapters)

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
