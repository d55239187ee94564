"""Prefill-only results of a decoder model: pooled vectors (embed) and yes/no scores (score).

An embed request's result is its last token's final hidden state (after the
model's last norm, before the LM head), L2-normalised: Qwen3-Embedding's
last-token pooling. A score request's is P(yes) = softmax(logit_no,
logit_yes)[1] at its last position: Qwen3-Reranker's reading of its own
answer. Both run through the scheduler, the paged KV and the packed step like
generation; this module only turns the step's rows into results.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxd.engined.request import Request
from mlxd.engined.scheduler import SchedulerOutput
from mlxd.shared.errors import ModelLoadError
from mlxd.shared.hub import load_tokenizer


def score_token_ids(tokenizer_dir: Path, score_tokens: str) -> tuple[int, int]:
    """The ids of ``--score-tokens`` "no,yes"; ModelLoadError unless each is one token of the vocabulary."""
    vocab = load_tokenizer(str(tokenizer_dir)).get_vocab()
    ids = []
    for text in score_tokens.split(","):
        token_id = vocab.get(text)
        if token_id is None:
            raise ModelLoadError(f"--score-tokens: {text!r} is not one token of this model's vocabulary")
        ids.append(token_id)
    return ids[0], ids[1]


def matryoshka_dimensions(model_dir: Path) -> list[int] | None:
    """The sizes the model's vectors may be cut to, from its config.json (vLLM's fields):
    ``matryoshka_dimensions`` lists them, ``is_matryoshka`` allows any ([]); None: no cutting."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) and d > 0 for d in dims):
        return sorted(dims)
    return [] if config.get("is_matryoshka") is True else None


def normalized(vectors: mx.array) -> mx.array:
    """Rows scaled to unit L2 norm, in float32 (a zero row stays zero)."""
    v = vectors.astype(mx.float32)
    return v / mx.maximum(mx.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def pooled_results(batch: SchedulerOutput, logits: mx.array, hidden: mx.array | None,
                   score_ids: tuple[int, int] | None) -> list[tuple[Request, mx.array]]:
    """(request, its result, not yet evaluated) for every pooled request whose prompt ends this step.

    ``logits`` and ``hidden`` are the runner's rows (``batch.num_logits``, ``batch.hidden_rows``,
    in batch order): an embed request's vector, a score request's P(yes).
    """
    results = []
    logit_row = hidden_row = 0
    embeds, scores = [], []
    for (req, _), k, h in zip(batch.scheduled, batch.num_logits, batch.hidden_rows):
        if h:
            embeds.append((req, hidden_row))
        elif k and req.task == "score":
            scores.append((req, logit_row + k - 1))
        logit_row += k
        hidden_row += h
    if embeds:
        vectors = normalized(hidden)
        results += [(req, vectors[row]) for req, row in embeds]
    if scores:
        no, yes = score_ids
        rows = logits[mx.array([row for _, row in scores])].astype(mx.float32)
        probs = mx.sigmoid(rows[:, yes] - rows[:, no])
        results += [(req, probs[i]) for i, (req, _) in enumerate(scores)]
    return results


def store_results(results: list[tuple[Request, mx.array]]) -> None:
    """Evaluate the results and keep them on their requests (float32 bytes, or a float)."""
    mx.eval([r for _, r in results])
    for req, value in results:
        if req.task == "embed":
            req.embedding = np.asarray(value, dtype=np.float32).astype("<f4").tobytes()
        else:
            req.score = float(value.item())
