"""Request and response bodies of the pooling routes: /v1/embeddings, /pooling, /v1/score, /rerank.

OpenAI's embeddings shapes, and vLLM's for pooling, score and rerank (the
Jina/Cohere rerank shape). Decoded strictly, unknown fields ignored, as the
OpenAI bodies are (``gateway.openai_types``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of lists of them (checked by shape).
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras.
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class PoolingData(msgspec.Struct):
    index: int
    data: list[float] | str
    object: str = "pooling"


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(msgspec.Struct):
    model: str
    data: list[EmbeddingData] | list[PoolingData]
    usage: PoolingUsage
    object: str = "list"
    id: str | msgspec.UnsetType = msgspec.UNSET
    created: int | msgspec.UnsetType = msgspec.UNSET


class ScoreRequest(msgspec.Struct, kw_only=True):
    # vLLM's pairing: one and one, one against many, or many against as many.
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    # Strings, or Cohere's {"text": ...} objects.
    documents: list[str | dict[str, Any]]
    model: str | None = None
    # None or 0: every document, ranked.
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int
    prompt_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
