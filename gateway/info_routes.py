"""The routes around generation: /health, /metrics, /version, /v1/models, /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import time

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxd.gateway import openai_types as t
from mlxd.gateway import params as P
from mlxd.gateway.state import GatewayState, ModelRouter, decode_body
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import PROTOCOL_VERSION

# /tokenize counts a text longer than the context (clients ask in order to shorten it), up to this many contexts.
COUNT_SLACK = 4


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mlxd")
    except Exception:
        return "0"


async def health(request: Request) -> Response:
    """200 with the engine's stats while it serves; 503 while it loads or is gone. With several engines,
    each model's status, and 200 while each serves or is stopped on purpose (to start on demand)."""
    router: ModelRouter = request.app.state.gw
    if router.named:
        return _models_health(router)
    gw = router.default
    client = gw.client
    if not client.ready or gw.tokenizer is None:
        return JSONResponse({"status": "unavailable", "reason": client.unavailable_reason},
                            status_code=503)
    stats = await client.fresh_stats() if request.query_params.get("fresh") else client.stats
    body = {"status": "ok", "model": client.info.served_model_name}
    if stats is not None:
        body["engine"] = msgspec.structs.asdict(stats)
    return JSONResponse(body)


def _models_health(router: ModelRouter) -> Response:
    models, ok = {}, True
    for e in router.engines:
        if e.client.ready and e.tokenizer is not None:
            models[e.served_name] = {"status": "ok"}
        elif router.fleet is not None and router.fleet.stopped(e.name):
            models[e.served_name] = {"status": "stopped"}
        else:
            models[e.served_name] = {"status": "unavailable", "reason": e.client.unavailable_reason}
            ok = False
    return JSONResponse({"status": "ok" if ok else "unavailable", "models": models}, status_code=200 if ok else 503)


async def metrics_endpoint(request: Request) -> Response:
    """GET /metrics: Prometheus's text format (no key: like /health, it says nothing of the prompts)."""
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def version(request: Request) -> Response:
    info = request.app.state.gw.default.client.info
    return JSONResponse({"version": _version(), "protocol_version": PROTOCOL_VERSION,
                         "engine_version": info.engine_version if info else None})


def _model_card(info) -> dict:
    return {"id": info.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "mlxd", "root": info.model_id, "parent": None, "max_model_len": info.max_model_len,
            # What it can be asked: generate (chat, completions), embed (/v1/embeddings), score (/rerank).
            "tasks": info.tasks}


def _unloaded_card(name: str) -> dict:
    """A model whose engine has not served yet (it starts on demand, or is loading): what is known."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "mlxd", "root": None,
            "parent": None}


def _adapter_card(info, adapter) -> dict:
    """A LoRA adapter as vLLM lists it: its own id, its path as root, the base model as parent."""
    return {"id": adapter.name, "object": "model", "created": int(time.time()), "owned_by": "mlxd",
            "root": adapter.path, "parent": info.served_model_name, "max_model_len": info.max_model_len}


async def models(request: Request) -> Response:
    """Every engine's model and the adapters the key may use; with one engine, 503 until it served."""
    router: ModelRouter = request.app.state.gw
    app = router.check_auth(request)
    if not router.named:
        router.default.require_ready()
    cards = []
    for gw in router.engines:
        info = gw.client.info
        if info is None:
            cards.append(_unloaded_card(gw.served_name))
        else:
            cards += [_model_card(info)] + [_adapter_card(info, a) for a in gw.adapters_for(app)]
    return JSONResponse({"object": "list", "data": cards})


async def model(request: Request) -> Response:
    """The openai SDK's ``models.retrieve``: the served model's or an adapter's card, 404 for any other name."""
    router: ModelRouter = request.app.state.gw
    app = router.check_auth(request)
    gw = router.find(request.path_params["model"], app)
    info = gw.client.info
    if not router.named:
        info, _ = gw.require_ready()
    elif info is None:
        return JSONResponse(_unloaded_card(gw.served_name))
    name = gw.check_model(request.path_params["model"], app)
    adapter = next((a for a in gw.client.lora_adapters if a.name == name), None)
    return JSONResponse(_adapter_card(info, adapter) if adapter else _model_card(info))


async def tokenize(request: Request) -> Response:
    app = request.app.state.gw.check_auth(request)
    req = await decode_body(request, t.TokenizeRequest)
    gw: GatewayState = await request.app.state.gw.engine_for(req.model, app)
    info, tok = gw.require_ready()
    gw.check_model(req.model, app)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        messages = P.message_dicts(req.messages)
        P.check_chat(messages, "messages", req.add_generation_prompt, req.continue_final_message, None, False)

        def count():
            text = tok.render_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message,
                                   chat_template_kwargs=req.chat_template_kwargs)
            P.check_prompt_bytes(text, info, tok.max_token_bytes, "messages", COUNT_SLACK)
            return tok.encode(text, add_special_tokens=False)
    else:
        def count():
            P.check_prompt_bytes(req.prompt, info, tok.max_token_bytes, "prompt", COUNT_SLACK)
            return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    ids = await asyncio.to_thread(count)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": info.max_model_len})


async def detokenize(request: Request) -> Response:
    app = request.app.state.gw.check_auth(request)
    req = await decode_body(request, t.DetokenizeRequest)
    gw: GatewayState = await request.app.state.gw.engine_for(req.model, app)
    info, tok = gw.require_ready()
    gw.check_model(req.model, app)
    if any(not 0 <= i < info.vocab_size for i in req.tokens):
        raise InvalidRequestError(f"token ids must be in [0, {info.vocab_size})", param="tokens")
    text = await asyncio.to_thread(tok.decode, req.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})
