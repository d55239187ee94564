"""The gateway's end of the wire: a DEALER socket to the engine, with handshake and reconnect.

One asyncio task reads the socket and routes each RequestOutput to the queue
of the HTTP request that owns it. The engine is "ready" from its READY until
any sign that it is gone: the socket's disconnect (a killed engine is seen at
once), a DEAD message, a PONG from a different engine instance, or silence
longer than ``engine_timeout``. Then every open request gets an
EngineUnavailableError and new ones are refused with 503, while the socket
keeps reconnecting and re-handshaking by itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mlxd.shared import protocol as p
from mlxd.shared.curve import secure_client
from mlxd.shared.errors import EngineUnavailableError, MlxdError, error_from_code
from mlxd.shared.protocol import Kind, SamplingParams

log = logging.getLogger("mlxd.gateway")

# What a request gets once the gateway is stopping (refused, or ended at the shutdown timeout).
SHUTTING_DOWN = "the server is shutting down"

_PING_INTERVAL = 0.5


class EngineClient:
    """``on_ready(info)`` runs (awaited) after each handshake, before requests are let in."""

    def __init__(self, endpoint: str, engine_timeout: float = 60.0,
                 on_ready: Callable[[p.EngineInfo], Awaitable[None]] | None = None,
                 curve_keys: str | None = None):
        self.endpoint = endpoint
        self.curve_keys = curve_keys
        self.engine_timeout = engine_timeout
        self.on_ready = on_ready
        self.info: p.EngineInfo | None = None  # the last engine seen; kept while it is gone
        self.stats: p.EngineStats | None = None
        self.ready = False
        self.unavailable_reason = "waiting for the engine to start"
        # request id -> (queue of the HTTP request, choice index)
        self._streams: dict[str, tuple[asyncio.Queue, int]] = {}
        self._last_heard = 0.0
        self._handshaking = False
        self._tasks: list[asyncio.Task] = []
        self._sock = None
        self._pong_waiters: list[tuple[float, asyncio.Future]] = []
        # The LoRA adapters the engine serves (from READY, each PONG and each runtime update).
        self.lora_adapters: list[p.LoraAdapter] = []
        # Set when the gateway begins to stop: nothing more is sent (the engine of `mlxd serve`, told in
        # the same moment, takes nothing more in), and the engine's going away is no loss.
        self.stopping = False

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, b"gw-" + uuid.uuid4().bytes[:12])
        # Not ZMQ_IMMEDIATE: with it, libzmq drops the frames already received but
        # not yet read when the connection closes, which are exactly the engine's
        # last words (per-request errors, DEAD). Frames sent while no engine is
        # connected wait for the next one instead; see _dispatch for orphans.
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        secure_client(self._sock, self.endpoint, self.curve_keys)
        self._sock.connect(self.endpoint)
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="engine-recv"),
            asyncio.create_task(self._monitor_loop(monitor), name="engine-monitor"),
            asyncio.create_task(self._heartbeat_loop(), name="engine-heartbeat"),
        ]

    async def close(self) -> None:
        if self._sock is not None and self.ready:
            self._send(Kind.BYE, p.Bye())
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(EngineUnavailableError("the gateway is shutting down"))
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=200)

    # -- requests -------------------------------------------------------------------------

    @property
    def open_requests(self) -> int:
        """Requests (and LoRA updates) sent and not yet finished: a busy engine is not idle."""
        return len(self._streams)

    def require_open(self) -> None:
        """EngineUnavailableError (503) once the gateway is stopping, whatever the engine's state."""
        if self.stopping:
            raise EngineUnavailableError(SHUTTING_DOWN)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            queue: asyncio.Queue, index: int = 0, cache_salt: str | None = None,
            app: str | None = None, priority: int = 0, group: tuple[str, int, int, int] | None = None,
            task: str = "generate", lora_name: str | None = None, images: list | None = None,
            audio: p.AudioInput | None = None) -> None:
        """Send a request; its outputs (or an MlxdError) arrive on ``queue`` as (index, item).
        EngineUnavailableError (503) once the gateway is stopping, or while the engine is gone.

        ``group`` (id, size, n, choice): the requests of one client request, sent one after
        another, which the engine admits to its waiting queue all or none; its n, and this
        request's choice among its prompt's n. ``task``: ``shared.protocol.TASKS``.
        """
        self.require_open()
        if not self.ready:
            raise EngineUnavailableError(self.unavailable_reason)
        self._streams[request_id] = (queue, index)
        group_id, group_size, n, choice = group if group is not None else (None, 1, 1, 0)
        if not self._send(Kind.ADD, p.AddRequest(request_id, prompt_ids, params, cache_salt, app, priority,
                                                 group_id, group_size, n, choice, task, lora_name, images,
                                                 audio)):
            del self._streams[request_id]
            raise EngineUnavailableError("the engine is not connected")

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests (a client went away, a stop string matched); unknown ids are ignored."""
        ids = [r for r in request_ids if self._streams.pop(r, None) is not None]
        if ids and self.ready:
            self._send(Kind.ABORT, p.Abort(ids))
        log.debug("abort %s: sent for %s", request_ids, ids)

    async def update_lora(self, action: str, name: str, path: str | None = None,
                          timeout: float = 120.0) -> list[p.LoraAdapter]:
        """Load (``path`` given) or unload an adapter in the engine; the adapters served after it.

        Raises the engine's MlxdError (a bad path: 404, a bad adapter: 400), or
        EngineUnavailableError when the engine is gone or does not answer in ``timeout``.
        """
        if not self.ready:
            raise EngineUnavailableError(self.unavailable_reason)
        op_id = "lora-" + uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[op_id] = (queue, 0)
        if not self._send(Kind.LORA, p.LoraUpdate(op_id=op_id, action=action, lora_name=name, lora_path=path)):
            del self._streams[op_id]
            raise EngineUnavailableError("the engine is not connected")
        try:
            _, item = await asyncio.wait_for(queue.get(), timeout)
        except asyncio.TimeoutError:
            self._streams.pop(op_id, None)
            raise EngineUnavailableError(f"the engine did not answer the LoRA {action} in {timeout:.0f}s") from None
        if isinstance(item, MlxdError):
            raise item
        return item.adapters

    async def fresh_stats(self, timeout: float = 2.0) -> p.EngineStats | None:
        """Stats from a PONG sent after this call (not the last heartbeat's)."""
        if not self.ready:
            return None
        fut = asyncio.get_running_loop().create_future()
        sent_at = time.time()
        self._pong_waiters.append((sent_at, fut))
        self._send(Kind.PING, p.Ping(sent_at))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None

    # -- internals ------------------------------------------------------------------------

    def _send(self, kind: Kind, payload) -> bool:
        """Send without waiting; False if the frame could not be queued."""
        # With NOBLOCK, pyzmq's asyncio socket tries the send at once and returns a
        # future already holding the result or the error.
        fut = self._sock.send_multipart(p.encode(kind, payload), zmq.NOBLOCK)
        if not fut.done():
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            return True
        exc = fut.exception()
        if exc is None:
            return True
        if isinstance(exc, zmq.Again):
            return False
        raise exc

    def _hello(self) -> None:
        self._send(Kind.HELLO, p.Hello(protocol_version=p.PROTOCOL_VERSION, pid=os.getpid()))

    def _lost(self, reason: str) -> None:
        """The engine is gone; the first reason given is the one clients see."""
        if self.ready:
            if self.stopping:
                log.info("the engine is gone, as the gateway stops: %s", reason)
            else:
                # The model's name: a gateway of several engines logs for each.
                log.warning("engine lost (%s): %s", self.info.served_model_name if self.info else self.endpoint,
                            reason)
            self.ready = False
            self.unavailable_reason = reason
        self._fail_all(EngineUnavailableError(self.unavailable_reason))

    def end_all(self, reason: str) -> int:
        """End every open request with an EngineUnavailableError (shutdown); how many there were."""
        n = len(self._streams)
        self._fail_all(EngineUnavailableError(reason))
        return n

    def _fail_all(self, err: MlxdError) -> None:
        streams, self._streams = self._streams, {}
        for queue, index in streams.values():
            queue.put_nowait((index, err))
        # An engine that is alive after all (silent through a long step, say) must not go on
        # running requests nobody reads: abort them (a dead engine's successor ignores the ids).
        if streams and self._sock is not None and not self._sock.closed:
            self._send(Kind.ABORT, p.Abort(list(streams)))

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                kind, msg = p.decode(frames)
            except p.MalformedFrame as e:
                log.warning("dropped a malformed frame from the engine: %s", e)
                continue
            self._last_heard = time.monotonic()
            try:
                await self._dispatch(kind, msg)
            except Exception:
                log.exception("failed to handle %s from the engine", kind.name)

    async def _dispatch(self, kind: Kind, msg) -> None:
        if kind is Kind.OUTPUTS:
            streams = self._streams
            orphans = []
            for out in msg.outputs:
                entry = streams.get(out.request_id)
                if entry is None:
                    # Aborted here already, or sent to an engine that died and queued
                    # for its successor: either way nobody reads it, so stop it.
                    if out.finish_reason is None:
                        orphans.append(out.request_id)
                    continue
                if out.finish_reason is not None:
                    del streams[out.request_id]
                entry[0].put_nowait((entry[1], out))
            if orphans:
                self._send(Kind.ABORT, p.Abort(orphans))
        elif kind is Kind.PONG:
            if self.info is not None and msg.instance_id != self.info.instance_id:
                self._lost("the engine restarted")
                self._hello()
                return
            self.stats = msg.stats
            self.lora_adapters = msg.lora_adapters
            # Only the answer to a waiter's own ping (or a later one) is fresh enough.
            waiting = []
            for sent_at, fut in self._pong_waiters:
                if fut.done():
                    continue
                if msg.sent_at >= sent_at:
                    fut.set_result(msg.stats)
                else:
                    waiting.append((sent_at, fut))
            self._pong_waiters = waiting
        elif kind is Kind.ERROR:
            err = error_from_code(msg.code, msg.message, msg.param)
            if msg.request_id is None:
                log.error("engine refused the handshake: %s", msg.message)
                self._lost(msg.message)
                return
            entry = self._streams.pop(msg.request_id, None)
            if entry is not None:
                entry[0].put_nowait((entry[1], err))
        elif kind is Kind.LORA_DONE:
            self.lora_adapters = msg.adapters
            entry = self._streams.pop(msg.op_id, None)
            if entry is not None:
                entry[0].put_nowait((entry[1], msg))
        elif kind is Kind.READY:
            await self._on_ready(msg)
        elif kind is Kind.DEAD:
            self._lost(f"the engine stopped: {msg.reason}")
        else:
            log.warning("dropped a %s frame: not an engine's message", kind.name)

    async def _on_ready(self, info: p.EngineInfo) -> None:
        if self.ready and self.info is not None and info.instance_id == self.info.instance_id:
            return  # an answer to a repeated HELLO
        if self._handshaking:
            return
        self._handshaking = True
        try:
            if self.info is not None and info.instance_id != self.info.instance_id:
                self._fail_all(EngineUnavailableError("the engine restarted"))
            if self.on_ready is not None:
                await self.on_ready(info)
            self.info = info
            self.lora_adapters = info.lora_adapters
            self.ready = True
            self._last_heard = time.monotonic()
            log.info("engine ready: %s (protocol %d, engine %s)", info.served_model_name,
                     info.protocol_version, info.engine_version)
        except Exception as e:
            log.exception("could not prepare for the engine's model")
            self.unavailable_reason = f"the gateway could not load the model's tokenizer: {e}"
        finally:
            self._handshaking = False

    async def _monitor_loop(self, monitor) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._hello()
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    # The monitor is a separate socket: let the engine's last frames
                    # (per-request errors, DEAD with its reason) be read first.
                    await asyncio.sleep(0.1)
                    self._lost("the engine disconnected")
        finally:
            monitor.close(linger=0)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(_PING_INTERVAL)
            if self.ready:
                if time.monotonic() - self._last_heard > self.engine_timeout:
                    self._lost(f"the engine has been silent for over {self.engine_timeout:.0f}s")
                    continue
                self._send(Kind.PING, p.Ping(time.time()))
            elif not self._handshaking:
                # Until READY: covers a HELLO lost to a connection made before the
                # engine was listening, and an engine that ignored the first one.
                self._hello()
