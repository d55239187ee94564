"""Every HTTP route of the gateway, in one table: path, handler, method."""

from __future__ import annotations

from starlette.routing import Route

from mlxd.gateway import anthropic, audio, embeddings, info_routes, lora_routes, responses, scoring
from mlxd.gateway.chat_run import chat_completions
from mlxd.gateway.completions import completions

ROUTES = [
    Route("/health", info_routes.health, methods=["GET"]),
    Route("/metrics", info_routes.metrics_endpoint, methods=["GET"]),
    Route("/version", info_routes.version, methods=["GET"]),
    Route("/v1/models", info_routes.models, methods=["GET"]),
    # Model ids may hold slashes (Hugging Face repo ids).
    Route("/v1/models/{model:path}", info_routes.model, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/messages", anthropic.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
    Route("/v1/responses", responses.responses, methods=["POST"]),
    Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
    Route("/pooling", embeddings.pooling, methods=["POST"]),
    Route("/score", scoring.score, methods=["POST"]),
    Route("/v1/score", scoring.score, methods=["POST"]),
    Route("/rerank", scoring.rerank, methods=["POST"]),
    Route("/v1/rerank", scoring.rerank, methods=["POST"]),
    Route("/v2/rerank", scoring.rerank, methods=["POST"]),
    Route("/v1/audio/transcriptions", audio.transcriptions, methods=["POST"]),
    Route("/v1/audio/translations", audio.translations, methods=["POST"]),
    Route("/tokenize", info_routes.tokenize, methods=["POST"]),
    Route("/detokenize", info_routes.detokenize, methods=["POST"]),
    Route("/v1/load_lora_adapter", lora_routes.load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", lora_routes.unload_lora_adapter, methods=["POST"]),
]
