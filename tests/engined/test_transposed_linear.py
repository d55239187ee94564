"""Linears holding their weight's transpose compute nn.Linear's outputs bit for bit, and a step's graph has no
Transpose node (engined.transposed_linear)."""

import collections
import re

import mlx.core as mx
import mlx.nn as nn
import pytest

from engined.engine import Engine
from engined.loaders import load_model
from engined.transposed_linear import TransposedLinear, hold_transposes
from shared.config import EngineConfig
from shared.protocol import SamplingParams
from tests.tiny_models import fresh_seed, make_tiny_model


def graph_census(tmp_path, *outputs) -> collections.Counter:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), *outputs)
    return collections.Counter(re.findall(r'label ="([^"]+)"', path.read_text()))


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_outputs_equal_nn_linear_s_bit_for_bit_and_follow_a_replaced_weight(bias, tmp_path):
    seed = fresh_seed("transposed linear")
    mx.random.seed(seed)
    plain = nn.Linear(48, 80, bias=bias)
    held = nn.Linear(48, 80, bias=bias)
    held.update(plain.parameters())
    holder = nn.Sequential(held)
    assert hold_transposes(holder) == 1 and type(held) is TransposedLinear
    x = mx.random.normal((5, 48))
    assert mx.array_equal(held(x), plain(x)).item()
    census = graph_census(tmp_path, held(x))
    assert census["Transpose"] == 0 and census["Matmul" if not bias else "AddMM"] == 1, census
    # Parameters are as before: the view is not one of them.
    assert sorted(k for k, _ in nn.utils.tree_flatten(held.parameters())) == sorted(
        k for k, _ in nn.utils.tree_flatten(plain.parameters()))
    plain.weight = held.weight = mx.random.normal((80, 48))
    assert mx.array_equal(held(x), plain(x)).item()


def test_a_decode_step_s_graph_has_no_transpose_and_greedy_tokens_are_mlx_lm_s(tmp_path):
    path = make_tiny_model(tmp_path / "qwen3", "qwen3", seed=fresh_seed("qwen3 model"))
    engine = Engine(EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=4), loaded=load_model(str(path)))
    reference = load_model(str(path)).model
    assert not any(type(m) in (nn.Linear, nn.Embedding) for _, m in engine.runner.model.named_modules())
    seen = []
    real = mx.async_eval

    def capture(*arrays):
        seen.append(graph_census(tmp_path, *arrays))
        return real(*arrays)

    prompt = [3, 14, 15, 92, 65, 35]
    mx.async_eval = capture
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    finally:
        mx.async_eval = real
    assert seen and all(c["Transpose"] == 0 and c["Matmul"] > 0 for c in seen), seen
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(mx.argmax(reference(mx.array(tokens)[None])[0, -1]).item())
    assert out == tokens[len(prompt):]
