"""The Starlette application: routes, error handling, and the engine client's lifetime."""

from __future__ import annotations

import contextlib
import time

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import anthropic
from gateway import openai_types as t
from gateway import responses
from gateway.errors import handle_exception
from gateway.routes import chat_completions, completions, read_body
from gateway.state import GatewayState
from shared.errors import InvalidRequestError, MlxdError
from shared.protocol import PROTOCOL_VERSION
from shared.serve_config import GatewayConfig

_json = msgspec.json.Encoder()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mlxd")
    except Exception:
        return "0"


async def health(request: Request) -> Response:
    """200 with the engine's stats while it serves; 503 while it loads or is gone."""
    gw: GatewayState = request.app.state.gw
    client = gw.client
    if not client.ready or gw.tokenizer is None:
        return JSONResponse({"status": "unavailable", "reason": client.unavailable_reason},
                            status_code=503)
    stats = await client.fresh_stats() if request.query_params.get("fresh") else client.stats
    body = {"status": "ok", "model": client.info.served_model_name}
    if stats is not None:
        body["engine"] = msgspec.structs.asdict(stats)
    return JSONResponse(body)


async def version(request: Request) -> Response:
    info = request.app.state.gw.client.info
    return JSONResponse({"version": _version(), "protocol_version": PROTOCOL_VERSION,
                         "engine_version": info.engine_version if info else None})


def _model_card(info) -> dict:
    return {"id": info.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "mlxd", "root": info.model_id, "max_model_len": info.max_model_len}


async def models(request: Request) -> Response:
    gw: GatewayState = request.app.state.gw
    gw.check_auth(request)
    info, _ = gw.require_ready()
    return JSONResponse({"object": "list", "data": [_model_card(info)]})


async def model(request: Request) -> Response:
    """The openai SDK's ``models.retrieve``: the served model's card, or 404 for any other name."""
    gw: GatewayState = request.app.state.gw
    gw.check_auth(request)
    info, _ = gw.require_ready()
    gw.check_model(request.path_params["model"])
    return JSONResponse(_model_card(info))


async def tokenize(request: Request) -> Response:
    gw: GatewayState = request.app.state.gw
    gw.check_auth(request)
    req = msgspec.json.decode(await read_body(request), type=t.TokenizeRequest)
    info, tok = gw.require_ready()
    gw.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        from gateway.tokenizer import message_dicts

        text = tok.render_chat(message_dicts(req.messages),
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               chat_template_kwargs=req.chat_template_kwargs)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": info.max_model_len})


async def detokenize(request: Request) -> Response:
    gw: GatewayState = request.app.state.gw
    gw.check_auth(request)
    req = msgspec.json.decode(await read_body(request), type=t.DetokenizeRequest)
    info, tok = gw.require_ready()
    gw.check_model(req.model)
    if any(not 0 <= i < info.vocab_size for i in req.tokens):
        raise InvalidRequestError(f"token ids must be in [0, {info.vocab_size})", param="tokens")
    return JSONResponse({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})


def build_app(config: GatewayConfig) -> Starlette:
    state = GatewayState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.client.start()
        try:
            yield
        finally:
            await state.client.close()

    middleware = []
    if config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                                     allow_methods=["*"], allow_headers=["*"]))
    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            # Model ids may hold slashes (Hugging Face repo ids).
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/messages", anthropic.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
            Route("/v1/responses", responses.responses, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
        ],
        exception_handlers={Exception: handle_exception, HTTPException: handle_exception,
                            MlxdError: handle_exception,
                            msgspec.ValidationError: handle_exception,
                            msgspec.DecodeError: handle_exception},
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.gw = state
    return app
