"""POST /v1/score (vLLM's text_1/text_2) and /rerank, /v1/rerank (query, documents): relevance scores.

How a pair is scored depends on what the model serves, as in vLLM:

- a scoring model (``--task score``, Qwen3-Reranker style) reads each pair
  as one prompt (``pair_ids``: through ``--chat-template`` when given, else
  the tokenizer's pair encoding, plain concatenation for a decoder's), and
  the engine returns P(yes) at its last position;
- an embedding model embeds every distinct text once and the score is the
  cosine similarity of the two vectors.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from mlxd.gateway import params as P
from mlxd.gateway import pooling_types as t
from mlxd.gateway.generation import while_connected
from mlxd.gateway.pooled import MAX_INPUTS, check_ids, input_ids, run_pooled, vectors
from mlxd.gateway.state import GatewayState, open_request
from mlxd.shared.errors import InvalidRequestError


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one with one, one with each of many, or many with as many, in order."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise InvalidRequestError("text_1 and text_2 must not be empty", param="text_1" if not firsts else "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidRequestError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
                                  "or as many as text_2", param="text_2")
    if len(seconds) > MAX_INPUTS:
        raise InvalidRequestError(f"at most {MAX_INPUTS} pairs per request", param="text_2")
    return list(zip(firsts, seconds))


def pair_ids(pairs, tok, info, truncate: int | None, param: str) -> list[list[int]]:
    """Each pair as one prompt of the scoring model (tokenizes: call it off the loop).

    With ``--chat-template`` the pair is rendered through it as two messages,
    roles ``query`` and ``document`` (how a reranker's instruction and answer
    prefix, Qwen3-Reranker's say, are put around them); else the tokenizer's
    pair encoding.
    """
    prompts = []
    for a, b in pairs:
        P.check_prompt_bytes(a + b, info, tok.max_token_bytes, param)
        if tok.chat_template:
            text = tok.render_chat([{"role": "query", "content": a}, {"role": "document", "content": b}])
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.hf(a, text_pair=b, add_special_tokens=True)["input_ids"]
        ids = P.truncate_prompt(list(ids), truncate, info)
        check_ids(ids, info, param)
        prompts.append(ids)
    return prompts


async def pair_scores(gw: GatewayState, request: Request, app: str | None, pairs: list[tuple[str, str]],
                      truncate: int | None, priority: int, param: str) -> tuple[list[float] | None, int]:
    """(one score per pair, or None when the client left; prompt tokens)."""
    info, tok = gw.require_ready()
    if "score" in info.tasks:
        prompts = await while_connected(asyncio.to_thread(pair_ids, pairs, tok, info, truncate, param),
                                        request.receive)
        outputs = await run_pooled(gw, request, prompts, "score", app, priority, param)
        scores = None if outputs is None else [o.score for o in outputs]
        return scores, sum(map(len, prompts))
    if "embed" in info.tasks:
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        prompts = await while_connected(asyncio.to_thread(input_ids, texts, tok, info, param, True, truncate),
                                        request.receive)
        outputs = await run_pooled(gw, request, prompts, "embed", app, priority, param)
        if outputs is None:
            return None, 0
        v = vectors(outputs)
        v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        row = {text: i for i, text in enumerate(texts)}
        return [float(v[row[a]] @ v[row[b]]) for a, b in pairs], sum(map(len, prompts))
    raise InvalidRequestError(f"the model `{info.served_model_name}` does not support scoring (/v1/score, "
                              "/rerank): it serves text generation", param="model")


async def score(request: Request) -> Response:
    gw, app, req, model = await open_request(request, t.ScoreRequest)
    pairs = score_pairs(req.text_1, req.text_2)
    scores, tokens = await pair_scores(gw, request, app, pairs, req.truncate_prompt_tokens, req.priority,
                                       "text_2")
    if scores is None:
        return Response(status_code=499)  # nobody is listening
    body = t.ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                           data=[t.ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                           usage=t.PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return Response(msgspec.json.encode(body), media_type="application/json")


def _document_texts(documents: list) -> list[str]:
    texts = []
    for i, d in enumerate(documents):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise InvalidRequestError("a document is a string or an object with a string text",
                                      param=f"documents[{i}]")
        texts.append(text)
    return texts


async def rerank(request: Request) -> Response:
    """Jina's and Cohere's rerank, as vLLM serves it: documents by relevance to the query, best first."""
    gw, app, req, model = await open_request(request, t.RerankRequest)
    if not req.documents:
        raise InvalidRequestError("documents must not be empty", param="documents")
    if req.top_n is not None and req.top_n < 0:
        raise InvalidRequestError("top_n must not be negative", param="top_n")
    texts = _document_texts(req.documents)
    pairs = score_pairs(req.query, texts)
    scores, tokens = await pair_scores(gw, request, app, pairs, req.truncate_prompt_tokens, req.priority,
                                       "documents")
    if scores is None:
        return Response(status_code=499)
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: req.top_n or None]
    results = [t.RerankResult(index=i, relevance_score=scores[i],
                              document=t.RerankDocument(texts[i]) if req.return_documents else None)
               for i in order]
    body = t.RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results,
                            usage=t.RerankUsage(total_tokens=tokens, prompt_tokens=tokens))
    return Response(msgspec.json.encode(body), media_type="application/json")
