"""Gemma 4's assistant from a quantized checkpoint (an mlx-community conversion: mlx_lm's
``quantization`` entry, scales and biases beside the packed weights): it loads as stored, runs dense
beside a dense target and quantized beside a quantized one, and drafts as well as the float one.

The targets, assistants and the trained pair are ``test_gemma4_assistant``'s fixtures.
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.engined.speculation.gemma4_assistant import load_assistant
from mlxd.shared.config import EngineConfig
from tests.engined.test_gemma4_assistant import (  # noqa: F401 (pair and trained are fixtures)
    ACCEPTANCE_FLOOR, GREEDY_32, KW, assistant_config, pair, save_assistant, spec_counts, trained)
from tests.engined.test_mtp import mixed_batch
from tests.tiny_models import assert_greedy_equal_up_to_ties, quantize_in_groups_of_32, seeded_rng

def quantize_assistant(assistant_dir, target_dir, out_dir, bits: int):
    """``assistant_dir``'s checkpoint quantized as mlx_lm's converter stores one (groups of 32, a
    ``quantization`` entry in config.json): every linear layer and the tied head."""
    loaded = load_model(str(target_dir))
    assistant = load_assistant(assistant_dir, loaded.model, loaded.model_type)
    quantize_in_groups_of_32(assistant, bits)
    config = json.loads((assistant_dir / "config.json").read_text())
    save_assistant(assistant, {**config, "quantization": {"group_size": 32, "bits": bits}}, out_dir)
    return assistant


def quantized_target(target_dir):
    loaded = load_model(str(target_dir))
    quantize_in_groups_of_32(loaded.model)
    return loaded


def test_a_quantized_assistant_runs_dense_beside_a_dense_target_and_quantized_beside_a_quantized_one(
        pair, tmp_path):
    target, assistant = pair
    stored = quantize_assistant(assistant, target, tmp_path / "q8", bits=8)
    dense = load_model(str(target))
    loaded = load_assistant(tmp_path / "q8", dense.model, dense.model_type)
    # Beside the float32 target: the stored values, dequantized.
    expected = dict(tree_flatten(stored.parameters()))
    checked = 0
    for name, module in loaded.named_modules():
        assert not isinstance(module, nn.QuantizedLinear), name
        if isinstance(module, nn.Linear) and f"{name}.scales" in expected:
            q = {part: expected[f"{name}.{part}"] for part in ("weight", "scales", "biases")}
            want = mx.dequantize(q["weight"], q["scales"], q["biases"], 32, 8)
            assert mx.array_equal(module.weight, want).item(), name
            checked += 1
    assert checked >= 2 * 4 + 3  # every layer's q/o/gate/up/down, both projections and the head
    # Beside a quantized target it stays quantized, head and centroids too.
    quantized = quantized_target(target)
    kept = load_assistant(tmp_path / "q8", quantized.model, quantized.model_type)
    assert isinstance(kept.lm_head, nn.QuantizedLinear)
    assert all(isinstance(layer.self_attn.q_proj, nn.QuantizedLinear) for layer in kept.layers)
    if "masked_embedding" in kept:
        # The masked head dequantizes only the selected clusters' rows: the same logits as the dense head.
        assert isinstance(kept.masked_embedding.centroids, nn.QuantizedLinear)
        h = mx.array(seeded_rng().standard_normal((5, kept.args.hidden_size)).astype(np.float32))
        got = kept.masked_embedding(h, kept.lm_head)
        want = loaded.masked_embedding(h, loaded.lm_head)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_greedy_outputs_with_a_quantized_assistant_beside_a_quantized_target_equal_plain_decoding(pair, tmp_path):
    target, assistant = pair
    quantize_assistant(assistant, target, tmp_path / "q4", bits=4)
    rng = seeded_rng()
    plain = Engine(EngineConfig(**KW), loaded=quantized_target(target))
    spec = Engine(EngineConfig(**KW, speculative_config=assistant_config(tmp_path / "q4", 3)),
                  loaded=quantized_target(target))
    assert isinstance(spec.mtp.assistant.lm_head, nn.QuantizedLinear)
    prompts, params = mixed_batch(rng)
    assert spec.generate(prompts, params) == plain.generate(prompts, params)
    assert spec_counts(spec)[0] > 0


def test_a_trained_assistant_quantized_to_8_bits_is_still_accepted(trained, tmp_path):
    target, assistant, prompts, continuations = trained
    quantize_assistant(assistant, target, tmp_path / "q8", bits=8)
    spec = Engine(EngineConfig(**KW, speculative_config=assistant_config(tmp_path / "q8", 2)),
                  loaded=load_model(str(target)))
    reference = load_model(str(target)).model  # mlx_lm's own forward, for the greedy choices
    assert_greedy_equal_up_to_ties(reference, prompts, spec.generate(prompts, GREEDY_32), continuations)
    drafted, accepted = spec_counts(spec)
    print(f"accepted {accepted:.0f} of {drafted:.0f} drafts")
    assert accepted / drafted > ACCEPTANCE_FLOOR
