"""config.json as transformers 5 writes it: every RoPE field under ``rope_parameters`` (one dict, or one
per layer type) and none at the top, where mlx_lm's families read them. The same weights must give
the same logits either way: on tiny models of each form, and on SmolLM2 (base 100,000, not the
10,000 a family falls back to) saved as a directory."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxd.engined.loaders import default_model_path, load_model
from mlxd.engined.loaders.gguf import load_gguf
from mlxd.engined.loaders.mlx_dir import rope_fields
from tests.tiny_models import make_tiny_model

TOKENS = mx.array([[264, 5, 72, 101, 108, 256, 111, 32, 199, 3, 64, 265, 17, 90, 41, 7]])
# The top fields transformers 5 moves under rope_parameters (Gemma 3's sliding base among them).
MOVED = ("rope_theta", "rope_scaling", "rope_local_base_freq", "partial_rotary_factor")


def transformers5_config(config: dict) -> dict:
    """``config`` with its RoPE fields where transformers 5 puts them: its own config class reads
    them and writes ``rope_parameters``; the top keeps none of them."""
    from transformers import AutoConfig

    if "text_config" in config:
        return {**config, "text_config": transformers5_config(config["text_config"])}
    fields = {k: v for k, v in config.items() if k != "model_type"}
    rope = AutoConfig.for_model(config["model_type"], **fields).rope_parameters
    return {**{k: v for k, v in config.items() if k not in MOVED}, "rope_parameters": rope}


def _resaved(src, dst, config: dict):
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _logits(path, tokens=TOKENS) -> np.ndarray:
    return np.array(load_model(str(path), dtype="float32").model(tokens))


# (tiny arch, fields of its config.json, or of its text_config for a wrapper): each form's bases
# and scaling away from the family's defaults, so that a field left unread shows.
FORMS = {
    "flat": ("llama", {"rope_theta": 250000.0}),
    "flat_llama3": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "flat_partial_longrope": ("phi3", {"rope_theta": 50000.0}),
    "per_layer_type": ("gemma3_text", {"rope_theta": 200000.0, "rope_local_base_freq": 50000.0,
                                       "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "per_layer_type_in_text_config": ("gemma3", {"rope_theta": 200000.0, "rope_local_base_freq": 50000.0}),
}


@pytest.mark.parametrize("form", FORMS)
def test_a_transformers_5_config_gives_the_logits_of_the_same_fields_at_the_top(form, tmp_path):
    arch, fields = FORMS[form]
    src = make_tiny_model(tmp_path / "top", arch, seed=11)
    config = json.loads((src / "config.json").read_text())
    (config["text_config"] if "text_config" in config else config).update(fields)
    (src / "config.json").write_text(json.dumps(config))
    moved = transformers5_config(config)
    text = moved.get("text_config", moved)
    assert not set(MOVED) & set(text) and text["rope_parameters"], text
    print(form, "rope_parameters:", text["rope_parameters"])
    want = _logits(src)
    got = _logits(_resaved(src, tmp_path / "moved", moved))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_rope_fields_of_each_form():
    assert rope_fields({"rope_theta": 5.0}) == {}
    assert rope_fields({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}) == {"rope_theta": 1e5}
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096,
            "partial_rotary_factor": 0.5}
    assert rope_fields({"rope_parameters": yarn}) == {
        "rope_theta": 1e6, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 4096,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 4096, "type": "yarn", "rope_type": "yarn"}}
    per_type = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert rope_fields({"rope_parameters": per_type}) == {
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "swa_rope_theta": 1e4,
        "rope_scaling": {"factor": 8.0, "type": "linear", "rope_type": "linear"}}


def test_smollm2_saved_by_transformers_5_gives_the_logits_of_its_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the GGUF's tokenizer cache
    gguf = load_gguf(default_model_path())
    assert gguf.config["rope_theta"] == 100000.0
    out = tmp_path / "smollm2"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(gguf.model.parameters())),
                        metadata={"format": "mlx"})
    config = transformers5_config(gguf.config)
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 100000.0
    (out / "config.json").write_text(json.dumps(config))

    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(gguf.tokenizer_dir)).encode(
        "The three largest cities of France are Paris, Marseille and")
    tokens = mx.array([ids])
    want = np.array(gguf.model(tokens))
    del gguf
    got = _logits(out, tokens)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
