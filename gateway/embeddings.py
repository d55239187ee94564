"""POST /v1/embeddings (OpenAI's shape) and /pooling (vLLM's): inputs in, their pooled vectors out.

The engine returns each input's vector as its model pools it (last token,
L2-normalised, for a decoder; the sentence-transformers pooling and
normalisation for an encoder). ``dimensions`` cuts vectors to their first
entries and renormalises them, only for models trained for it (Matryoshka).
``encoding_format: base64`` is the float32 little-endian bytes, as OpenAI's
SDK expects (it asks for it by default).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from mlxd.gateway import params as P
from mlxd.gateway import pooling_types as t
from mlxd.gateway.generation import while_connected
from mlxd.gateway.pooled import input_ids, run_pooled, vectors
from mlxd.gateway.state import GatewayState, decode_body
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import EngineInfo


def check_dimensions(dimensions: int | None, info: EngineInfo) -> None:
    """400 unless ``dimensions`` is None, the full size, or a size the model was trained to be cut to."""
    full = info.embedding_dim
    if dimensions is None or dimensions == full:
        return
    allowed = info.matryoshka_dimensions
    if allowed is None:
        raise InvalidRequestError(f"the model `{info.served_model_name}` does not support matryoshka "
                                  f"representation: dimensions must be omitted or {full}", param="dimensions")
    if not 1 <= dimensions <= full or (allowed and dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {full}"
        raise InvalidRequestError(f"dimensions must be one of {sizes}", param="dimensions")


def cut_dimensions(v: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Vectors cut to their first ``dimensions`` entries and renormalised (checked by ``check_dimensions``)."""
    if dimensions is None or dimensions == v.shape[1]:
        return v
    v = v[:, :dimensions]
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def _encoded(v: np.ndarray, encoding_format: str) -> list:
    if encoding_format == "base64":
        return [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in v]
    return v.tolist()


async def _pooled_vectors(request: Request, app: str | None, req: t.EmbeddingRequest):
    """(info, model name, vectors [n, dim] or None when the client left, prompt tokens)."""
    gw: GatewayState = await request.app.state.gw.engine_for(req.model, app)
    info, tok = gw.require_ready()
    model = gw.check_model(req.model, app)
    P.check_task(info, "embed")
    check_dimensions(req.dimensions, info)
    prompts = await while_connected(asyncio.to_thread(input_ids, req.input, tok, info, "input",
                                                      req.add_special_tokens, req.truncate_prompt_tokens),
                                    request.receive)
    outputs = await run_pooled(gw, request, prompts, "embed", app, req.priority, "input")
    if outputs is None:
        return info, model, None, 0
    return info, model, cut_dimensions(vectors(outputs), req.dimensions), sum(map(len, prompts))


async def embeddings(request: Request) -> Response:
    app = request.app.state.gw.check_auth(request)
    req = await decode_body(request, t.EmbeddingRequest)
    info, model, v, tokens = await _pooled_vectors(request, app, req)
    if v is None:
        return Response(status_code=499)  # nobody is listening
    data = [t.EmbeddingData(index=i, embedding=e) for i, e in enumerate(_encoded(v, req.encoding_format))]
    body = t.EmbeddingResponse(model=model, data=data, usage=t.PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return Response(msgspec.json.encode(body), media_type="application/json")


async def pooling(request: Request) -> Response:
    """vLLM's /pooling: the same vectors, in its ``data`` shape, with an id."""
    app = request.app.state.gw.check_auth(request)
    req = await decode_body(request, t.EmbeddingRequest)
    info, model, v, tokens = await _pooled_vectors(request, app, req)
    if v is None:
        return Response(status_code=499)
    data = [t.PoolingData(index=i, data=e) for i, e in enumerate(_encoded(v, req.encoding_format))]
    body = t.EmbeddingResponse(model=model, data=data, id=f"pool-{uuid.uuid4().hex}", created=int(time.time()),
                               usage=t.PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return Response(msgspec.json.encode(body), media_type="application/json")
