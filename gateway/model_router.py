"""The gateway's engines, one per model, and which of them serves a request.

`mlxd gateway` talks to one engine (``--engine-endpoint``) or to several (``--model-endpoints
NAME=ENDPOINT ...``, which `mlxd serve MODEL MODEL ...` writes), each its own process with its own
model and memory. A request names its model; ``engine_for`` finds the engine serving it (its
declared name, the engine's served name or model id, or a LoRA adapter the key may use) and
answers any other name with a 404 listing those served. Each engine has its own client,
tokenizer and parsers (``GatewayState``), so one engine's loss fails its own requests alone. The
key file and the app of a key are the process's: a key works for every model, and each engine
shares its own batch fairly among the apps that use it.

Under `mlxd serve --keep-alive` the serve process starts and stops the engines (its ``fleet``,
which owns their processes and the memory budget; see mlxd/fleet.py). A request for a model
whose engine is stopped asks the fleet to start it and waits for its READY, up to
--model-load-timeout; a fleet that cannot start it (the budget is held by busy models, or the
model failed to load) says why, and the request gets that as a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from mlxd.gateway.state import GatewayState, KeyChecker, exposure_warning
from mlxd.shared.errors import EngineUnavailableError, NotFoundError
from mlxd.shared.keys import default_keys_file
from mlxd.shared.paths import default_engine_endpoint
from mlxd.shared.serve_config import GatewayConfig

log = logging.getLogger("mlxd.gateway")

_WAKE_POLL_S = 0.1


class Fleet(Protocol):
    """What the gateway may ask of the process that owns the engines' lifetimes."""

    def want(self, name: str | None) -> str | None:
        """Have ``name``'s engine run: None when a request should wait for its READY (it is starting,
        or was started by this call), else why it should not wait (it cannot start now)."""

    def stopped(self, name: str | None) -> bool:
        """Whether ``name``'s engine is down on purpose (not started yet, or idle past --keep-alive)."""


class ModelRouter:
    """The engines of the config (``GatewayConfig.engines``), in order: the first is the default,
    which a request naming no model gets."""

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
