"""The Starlette application: the route table, error handling, browser checks and the engine client's lifetime."""

from __future__ import annotations

import contextlib

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from gateway.browser_guard import BrowserGuard
from gateway.errors import handle_exception
from gateway.metrics import GatewayMetrics, HTTPMetrics
from gateway.parsers import check_names
from gateway.routes import ROUTES
from gateway.state import GatewayState
from shared.errors import MlxdError
from shared.serve_config import GatewayConfig


def build_app(config: GatewayConfig) -> Starlette:
    check_names(config.tool_call_parser, config.reasoning_parser)
    state = GatewayState(config)
    metrics = GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.client.start()
        try:
            yield
        finally:
            await state.client.close()

    # Metrics see every request, a refused one too; then the guard: a refused browser request
    # never reaches CORS or a route.
    middleware = [Middleware(HTTPMetrics, metrics=metrics, routes=ROUTES),
                  Middleware(BrowserGuard, bind_host=config.host, allowed_hosts=config.allowed_hosts,
                               allowed_origins=config.allowed_origins)]
    if config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                                     allow_methods=["*"], allow_headers=["*"]))
    app = Starlette(
        routes=ROUTES,
        exception_handlers={Exception: handle_exception, HTTPException: handle_exception,
                            MlxdError: handle_exception,
                            msgspec.ValidationError: handle_exception,
                            msgspec.DecodeError: handle_exception},
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.gw = state
    app.state.metrics = metrics
    return app
