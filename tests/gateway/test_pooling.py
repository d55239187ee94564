"""The pooling routes' own rules: Matryoshka cuts, vLLM's score pairing, the task a model serves."""

import numpy as np
import pytest

from mlxd.gateway.embeddings import check_dimensions, cut_dimensions
from mlxd.gateway.params import Tokenizer, check_task
from mlxd.gateway.scoring import pair_ids, score_pairs
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import EngineInfo
from tests.tiny_models import make_tiny_model, seeded_rng


def info(tasks=("embed",), dims=None, dim=8) -> EngineInfo:
    return EngineInfo(model_id="m", served_model_name="m", tokenizer_dir="/t", max_model_len=128, block_size=16,
                      num_kv_blocks=1, vocab_size=272, eos_token_ids=[], tasks=list(tasks), embedding_dim=dim,
                      matryoshka_dimensions=dims, protocol_version=5, engine_version="0", instance_id="i")


def test_dimensions_cut_and_renormalise_only_where_the_model_allows():
    v = seeded_rng().standard_normal((3, 8)).astype(np.float32)
    check_dimensions(4, info(dims=[]))
    check_dimensions(4, info(dims=[2, 4, 8]))
    cut = cut_dimensions(v, 4)
    assert cut.shape == (3, 4) and np.allclose(np.linalg.norm(cut, axis=1), 1)
    assert np.allclose(cut * np.linalg.norm(v[:, :4], axis=1, keepdims=True), v[:, :4], atol=1e-6)
    check_dimensions(8, info())  # the full size is no cut
    for dims, asked, match in ((None, 4, "does not support matryoshka"), ([2, 8], 4, "one of 2, 8"),
                               ([], 9, "1 to 8"), ([], 0, "1 to 8")):
        with pytest.raises(InvalidRequestError, match=match) as e:
            check_dimensions(asked, info(dims=dims))
        assert e.value.param == "dimensions"


def test_score_pairs_as_vllm_pairs_them():
    assert score_pairs("q", "d") == [("q", "d")]
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    with pytest.raises(InvalidRequestError, match="give one text_1, or as many as text_2"):
        score_pairs(["q", "r"], ["a", "b", "c"])
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        score_pairs([], "a")


def test_a_model_is_asked_only_for_its_tasks():
    check_task(info(("generate",)), "generate")
    with pytest.raises(InvalidRequestError, match="does not support embeddings.*serves text generation") as e:
        check_task(info(("generate",)), "embed")
    assert e.value.param == "model"
    with pytest.raises(InvalidRequestError, match="does not support text generation.*serves embeddings"):
        check_task(info(("embed",)), "generate")


RERANK_TEMPLATE = ("<|im_start|>system\nAnswer yes or no.<|im_end|>\n<|im_start|>user\n"
                   "{% for m in messages %}<{{ m.role }}>: {{ m.content }}\n{% endfor %}<|im_end|>\n"
                   "<|im_start|>assistant:")


def test_a_reranker_pair_is_one_prompt_through_the_operators_template_or_the_pair_encoding(tmp_path):
    path = make_tiny_model(tmp_path / "m", "qwen3")
    pairs = [("cats", "a cat sat"), ("cats", "stocks")]
    plain = Tokenizer(str(path))
    assert pair_ids(pairs, plain, info(("score",)), None, "documents") == [plain.encode("catsa cat sat"),
                                                                         plain.encode("catsstocks")]
    templated = Tokenizer(str(path), RERANK_TEMPLATE)
    ids = pair_ids(pairs[:1], templated, info(("score",)), None, "documents")
    text = ("<|im_start|>system\nAnswer yes or no.<|im_end|>\n<|im_start|>user\n<query>: cats\n"
            "<document>: a cat sat\n<|im_end|>\n<|im_start|>assistant:")
    assert ids == [templated.encode(text, add_special_tokens=False)]
    assert ids[0][0] == templated.hf.convert_tokens_to_ids("<|im_start|>")
