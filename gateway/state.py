"""What the gateway holds for one engine (``GatewayState``): its client (``EngineClient``, the gateway's
end of the wire), its model's tokenizer and parsers, and the process's config and view of the key file
(``KeyChecker``, reloaded whenever the file changes, so a revoked key stops working at once;
``shared.keys`` is the file itself, which `mlxd keys` writes); ``ModelRouter`` holds one per engine and
routes a request to its model's. ``open_request`` is the opening every model route shares, and
``decode_body`` the request body's read: size, time and nesting bounded, JSON into a typed Struct, every
refusal an InvalidRequestError (or a subclass with its own status), so that a hostile body is a 4xx and
never an exception the route did not expect.

The client (at the end) is a DEALER socket to the engine, with handshake and reconnect. One asyncio
task reads the socket and routes each RequestOutput to the queue of the HTTP request that owns it. The
engine is "ready" from its READY until any sign that it is gone: the socket's disconnect (a killed
engine is seen at once), a DEAD message, a PONG from a different engine instance, or silence longer
than ``engine_timeout``. Then every open request gets an EngineUnavailableError and new ones are
refused with 503, while the socket keeps reconnecting and re-handshaking by itself.

The routes import this module; ``gateway.server`` builds the app over it.

Over 400 lines because the engine's client and the state that reads it are one engine's side of the
gateway: readiness, the engine's info and adapters and the open streams are the client's, and every
check of the opening the routes share (a ready engine, the model's name, the adapters a key may use,
the wait for an engine started on demand) reads them.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import msgspec
import zmq
import zmq.asyncio
from starlette.requests import Request
from zmq.utils.monitor import parse_monitor_message

from mlxd.gateway import access_log
from mlxd.gateway.params import (MAX_JSON_DEPTH, SamplingDefaults, Tokenizer, check_depth, load_chat_template,
                            sampling_defaults)
from mlxd.gateway.parsers import choose_parsers
from mlxd.shared import protocol as p
from mlxd.shared.curve import check_endpoint, secure_client
from mlxd.shared.errors import (AuthenticationError, EngineUnavailableError, InvalidRequestError, MlxdError, NotFoundError,
                           RequestTimeoutError, RequestTooLargeError, error_from_code)
from mlxd.shared.keys import KeyFile, default_keys_file, match_key, read_keys, required_marker
from mlxd.shared.paths import check_ipc_endpoint, default_engine_endpoint
from mlxd.shared.protocol import EngineInfo, Kind, SamplingParams
from mlxd.shared.serve_config import GatewayConfig

log = logging.getLogger("mlxd.gateway")


def exposure_warning(host: str, keys_required: bool) -> str | None:
    """A warning when the gateway listens beyond loopback with no key required, else None."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if loopback or keys_required:
        return None
    return (f"listening on {host} with no API key: anyone who can reach this port can use the model "
            "(set --api-key or add keys with `mlxd keys add APP`)")


class GatewayState:
    """One engine's side of the gateway. ``name``: the model it serves as the config declares it
    (None: the one engine, known by its READY); ``keys``: the process's, shared by every engine."""

    def __init__(self, config: GatewayConfig, keys: "KeyChecker", endpoint: str, name: str | None = None):
        self.config = config
        self.name = name
        self.chat_template = load_chat_template(config.chat_template)
        self.tokenizer: Tokenizer | None = None
        # The flags' parsers; "auto" is resolved from the model's chat template once it is known.
        self.parsers = choose_parsers(config.tool_call_parser, config.reasoning_parser, self.chat_template)
        self.sampling_defaults = SamplingDefaults(**config.generation_override)
        self.keys = keys
        # Monotonic time of the last request routed here (the keep-alive counts from it).
        self.last_used = time.monotonic()
        # A socket planted in a directory others can write would receive every prompt.
        check_ipc_endpoint(endpoint, create=False)
        check_endpoint(endpoint, config.curve_keys)
        self.client = EngineClient(endpoint, engine_timeout=config.engine_timeout, on_ready=self._on_engine_ready,
                                   curve_keys=config.curve_keys,
                                   tap=access_log.tap if config.enable_log_requests else None)

    @property
    def served_name(self) -> str | None:
        """The model's name as clients use it: the engine's once it was seen, else the declared one."""
        info = self.client.info
        return info.served_model_name if info is not None else self.name

    def serves(self, name: str, app: str | None) -> bool:
        """Whether ``name`` is this engine's model (its served name or id) or an adapter ``app`` may use."""
        info = self.client.info
        if name == self.name or (info is not None and name in (info.served_model_name, info.model_id)):
            return True
        return any(a.name == name for a in self.adapters_for(app))

    async def _on_engine_ready(self, info: EngineInfo) -> None:
        """Load the tokenizer of the engine's model (again only if the model changed)."""
        if self.tokenizer is None or self.tokenizer.tokenizer_dir != info.tokenizer_dir:
            log.info("loading the tokenizer from %s", info.tokenizer_dir)
            self.tokenizer = await asyncio.to_thread(Tokenizer, info.tokenizer_dir, self.chat_template)
            cfg = self.config
            template = self.chat_template or getattr(self.tokenizer.hf, "chat_template", None)
            self.parsers = choose_parsers(cfg.tool_call_parser, cfg.reasoning_parser, template)
            log.info("parsers: tool calls %s (tool choice format %s), reasoning %s",
                     self.parsers.tool, self.parsers.tool_format, self.parsers.reasoning)
            try:
                self.sampling_defaults = sampling_defaults(cfg.generation_config, info.tokenizer_dir,
                                                           cfg.generation_override)
            except InvalidRequestError as e:
                # A model's broken file must not keep the gateway from serving: say so, use OpenAI's.
                log.warning("ignoring the model's generation config: %s", e.message)
                self.sampling_defaults = SamplingDefaults(**cfg.generation_override)
            log.info("sampling defaults: %s", self.sampling_defaults)

    def check_auth(self, request: Request) -> str | None:
        """The app of the request's key (None for --api-key or no auth); 401 for a bad key.

        Keys are required when --api-key is set or any app has a key (`mlxd keys add`).
        """
        key = self.config.api_key
        keys_active = self.keys.active
        if key is None and not keys_active:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            # Anthropic's clients send the key as x-api-key.
            token = request.headers.get("x-api-key", "")
        token = token.strip()
        if token:
            if key is not None and hmac.compare_digest(token.encode(), key.encode()):
                return None
            if keys_active:
                app = self.keys.app_of(token)
                if app is not None:
                    return app
        raise AuthenticationError("invalid or missing API key")

    def require_ready(self):
        """(EngineInfo, Tokenizer) of a connected engine, or EngineUnavailableError (503)."""
        client = self.client
        client.require_open()  # first: the engine may be gone too, and the server's state is what a client needs
        if not client.ready or client.info is None or self.tokenizer is None:
            raise EngineUnavailableError(f"the engine is not available: {client.unavailable_reason}")
        return client.info, self.tokenizer

    def adapters_for(self, app: str | None) -> list:
        """The LoRA adapters served that ``app`` (``check_auth``'s answer) may use, in order."""
        allowed = self.keys.loras_of(app)
        return [a for a in self.client.lora_adapters if allowed is None or a.name in allowed]

    def check_model(self, name: str | None, app: str | None) -> str:
        """The name to answer with (the base's or a LoRA adapter ``app`` may use); NotFoundError (404) for
        another. An adapter the app's key does not allow is answered as OpenAI answers a model a key has
        no access to: 404, never saying whether it exists."""
        info = self.client.info
        if name is None or name in (info.served_model_name, info.model_id):
            return info.served_model_name
        adapters = [a.name for a in self.adapters_for(app)]
        if name in adapters:
            return name
        raise NotFoundError(f"The model `{name}` does not exist or you do not have access to it; this server "
                            f"serves `{info.served_model_name}`"
                            + (f" and the LoRA adapters {', '.join(f'`{a}`' for a in adapters)}" if adapters else "")
                            + ".", param="model")

    def lora_name(self, model: str) -> str | None:
        """The adapter a checked model name (``check_model``'s answer) runs under; None for the base."""
        return None if model == self.client.info.served_model_name else model


_WAKE_POLL_S = 0.1


class Fleet(Protocol):
    """What the gateway may ask of the process that owns the engines' lifetimes."""

    def want(self, name: str | None) -> str | None:
        """Have ``name``'s engine run: None when a request should wait for its READY (it is starting,
        or was started by this call), else why it should not wait (it cannot start now)."""

    def stopped(self, name: str | None) -> bool:
        """Whether ``name``'s engine is down on purpose (not started yet, or idle past --keep-alive)."""


class ModelRouter:
    """The gateway's engines, one per model (``GatewayConfig.engines``, in order: the first is the
    default, which a request naming no model gets), and which of them serves a request.

    `mlxd gateway` talks to one engine (``--engine-endpoint``) or to several (``--model-endpoints
    NAME=ENDPOINT ...``, which `mlxd serve MODEL MODEL ...` writes), each its own process with its
    own model and memory. ``engine_for`` finds the engine serving a request's model (its declared
    name, the engine's served name or model id, or a LoRA adapter the key may use) and answers any
    other name with a 404 listing those served. Each engine has its own client, tokenizer and
    parsers, so one engine's loss fails its own requests alone. The key file and a key's app are
    the process's: a key works for every model, and each engine shares its batch fairly among the
    apps that use it.

    Under `mlxd serve --keep-alive` the serve process starts and stops the engines (its ``fleet``,
    which owns their processes and the memory budget; see mlxd/fleet.py). A request for a model
    whose engine is stopped asks the fleet to start it and waits for its READY, up to
    --model-load-timeout; a fleet that cannot start it (the budget is held by busy models, or the
    model failed to load) says why, and the request gets that as a 503 with Retry-After.
    """

    def __init__(self, config: GatewayConfig, fleet: Fleet | None = None):
        self.config = config
        self.fleet = fleet
        self.keys = KeyChecker(config.keys_file or default_keys_file())
        self.engines = [GatewayState(config, self.keys, endpoint or default_engine_endpoint(), name)
                        for name, endpoint in config.engines]
        warning = exposure_warning(config.host, config.api_key is not None or self.keys.active)
        if warning:
            log.warning(warning)

    @property
    def default(self) -> GatewayState:
        return self.engines[0]

    @property
    def named(self) -> bool:
        """A set of models named by the config (``--model-endpoints``), listed and routed by name even
        while their engines are down; else one engine, known from its READY."""
        return bool(self.config.model_endpoints)

    def check_auth(self, request) -> str | None:
        """The app of the request's key (one key file and --api-key for every engine)."""
        return self.default.check_auth(request)

    def find(self, name: str | None, app: str | None) -> GatewayState:
        """The engine serving ``name`` (the default for None, and for any name with one engine: its
        own check answers a wrong name); NotFoundError (404) listing the models served."""
        if name is None or not self.named:
            return self.default
        for engine in self.engines:
            if engine.serves(name, app):
                return engine
        served = [n for n in self.model_names(app) if n is not None]
        raise NotFoundError(f"The model `{name}` does not exist or you do not have access to it; this server "
                            f"serves {', '.join(f'`{n}`' for n in served)}.", param="model")

    def model_names(self, app: str | None) -> list[str | None]:
        """Every model served, each engine's base then the adapters ``app`` may use."""
        return [n for e in self.engines for n in (e.served_name, *(a.name for a in e.adapters_for(app)))]

    async def engine_for(self, name: str | None, app: str | None) -> GatewayState:
        """``find``, and with a fleet, the engine started on demand and waited for (see the module doc)."""
        engine = self.find(name, app)
        engine.last_used = time.monotonic()
        if self.fleet is None or engine.client.ready:
            return engine
        deadline = time.monotonic() + self.config.model_load_timeout
        while not engine.client.ready:
            engine.client.require_open()
            reason = self.fleet.want(engine.name)
            if reason is not None:
                raise EngineUnavailableError(f"the model `{engine.served_name}` is not available: {reason}")
            if time.monotonic() >= deadline:
                raise EngineUnavailableError(f"the model `{engine.served_name}` did not load within "
                                             f"{self.config.model_load_timeout:g} s")
            engine.last_used = time.monotonic()
            await asyncio.sleep(_WAKE_POLL_S)
        return engine

    def idle_seconds(self) -> dict[str | None, float]:
        """Per model, seconds since its last request ended or began (0 while any is open)."""
        now = time.monotonic()
        idle = {}
        for e in self.engines:
            if e.client.open_requests:
                e.last_used = now
            idle[e.name] = now - e.last_used
        return idle

    async def start(self) -> None:
        for e in self.engines:
            await e.client.start()

    async def close(self) -> None:
        await asyncio.gather(*(e.client.close() for e in self.engines))


Body = TypeVar("Body")


async def open_request(request: Request, typ: type[Body]) -> tuple[GatewayState, str, Body, str]:
    """The opening every model route shares, in the order its errors must come: the key (401), the
    body (400), the model's engine (404 for a model none serves), the engine (503), the model the key may
    use (404). Returns (the engine's state, app, body, model)."""
    router = request.app.state.gw
    app = router.check_auth(request)
    req = await decode_body(request, typ)
    gw = await router.engine_for(req.model, app)
    gw.require_ready()
    return gw, app, req, gw.check_model(req.model, app)


class KeyChecker:
    """The gateway's view of the key file, reloaded whenever the file changes.

    Built at start-up, it reads the file at once, so a damaged one is a
    start-up error (MlxdError, naming the file) rather than every request's.
    """

    def __init__(self, path: str):
        self.path = path
        self.marker = required_marker(path)
        self._stamp: tuple | None = None
        self._keys = KeyFile()
        # Once keys were seen (the file or its marker), they stay required for this process.
        self._required = False
        self._damaged = False
        self._refresh(at_start=True)

    def _refresh(self, at_start: bool = False) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            try:
                self._keys = read_keys(self.path) if stamp is not None else KeyFile()
                self._damaged = False
            except MlxdError as e:
                if at_start:
                    raise
                log.error("%s; refusing every request until it is fixed", e.message)
                self._keys, self._damaged = KeyFile(), True
            self._stamp = stamp
        if stamp is not None or os.path.exists(self.marker):
            self._required = True

    @property
    def active(self) -> bool:
        """Whether requests must present a key: any app has or ever had one (see the module doc)."""
        self._refresh()
        if self._damaged:
            # Not the client's fault, and the file's path is the server's business.
            raise MlxdError("the server's API key file is damaged; see the server log")
        return self._required

    def app_of(self, presented: str) -> str | None:
        self._refresh()
        return match_key(self._keys, presented)

    def loras_of(self, app: str | None) -> list[str] | None:
        """The adapters ``app`` may use (as the file says now); None: any (also for no app)."""
        if app is None:
            return None
        self._refresh()
        return next((k.loras for k in self._keys.keys if k.app == app), None)


# Far above any context window's worth of text; stops a client from filling the gateway's memory.
MAX_BODY_BYTES = 64 << 20


async def read_body(request: Request) -> bytes:
    """The request body, refusing (413) one over MAX_BODY_BYTES before or while reading it, and
    (408) one whose next chunk does not arrive within --request-timeout seconds (a client that
    stops mid-body would otherwise hold its connection and its task)."""
    idle_timeout = request.app.state.gw.config.request_timeout
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestTooLargeError(f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), idle_timeout)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"no part of the request body arrived for {idle_timeout:g} s") from None
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestTooLargeError(f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


def decode(body: bytes, typ):
    """``body`` as a ``typ`` Struct; msgspec's ValidationError (a 400 naming the field) when it does not fit."""
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        raise InvalidRequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
    check_depth(value)
    return msgspec.convert(value, typ)


# Bodies above this are decoded in a worker thread: tens of MB of JSON take the loop's time.
THREAD_DECODE_BYTES = 1 << 20


async def decode_body(request: Request, typ):
    """Read and decode a request body into ``typ``."""
    body = await read_body(request)
    if len(body) > THREAD_DECODE_BYTES:
        return await asyncio.to_thread(decode, body, typ)
    return decode(body, typ)


# The engine's client: the gateway's end of the wire (see the module docstring).

# What a request gets once the gateway is stopping (refused, or ended at the shutdown timeout).
SHUTTING_DOWN = "the server is shutting down"

_PING_INTERVAL = 0.5


class EngineClient:
    """``on_ready(info)`` runs (awaited) after each handshake, before requests are let in. ``tap(queue,
    request_id, app)``, where given, is what ``add`` routes a request's outputs to in place of its queue
    (``access_log.tap``, under --enable-log-requests)."""

    def __init__(self, endpoint: str, engine_timeout: float = 60.0,
                 on_ready: Callable[[p.EngineInfo], Awaitable[None]] | None = None,
                 curve_keys: str | None = None, tap: Callable[[asyncio.Queue, str, str | None], Any] | None = None):
        self.endpoint = endpoint
        self.tap = tap
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
        if self.tap is not None:
            queue = self.tap(queue, request_id, app)
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
