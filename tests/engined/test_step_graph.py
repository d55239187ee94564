"""A step's graph carries no node it can do without: linears hold their weight's transpose
(engined.runner.hold_transposes), computing nn.Linear's outputs bit for bit, and the families of
``model_layers.FLAT_STREAM`` run on a 2-D stream, without the packed batch's reshapes and broadcasts."""

import collections
import re

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.runner import TransposedEmbedding, TransposedLinear, hold_transposes
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
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


def decode_graphs(tmp_path, engine, prompt, n):
    """Greedy tokens of ``prompt`` and the census of every step's graph."""
    seen = []
    real = mx.async_eval

    def capture(*arrays):
        seen.append(graph_census(tmp_path, *arrays))
        return real(*arrays)

    mx.async_eval = capture
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
    finally:
        mx.async_eval = real
    return out, seen


def test_a_decode_step_s_graph_has_no_transpose_and_a_flat_stream_no_reshape_into_the_batch(tmp_path):
    path = make_tiny_model(tmp_path / "qwen3", "qwen3", seed=fresh_seed("qwen3 model"))
    # The pure-MLX attention, so that the whole step is one graph (the CPU's own route runs on the host).
    engine = Engine(EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=4, attention_backend="reference"),
                    loaded=load_model(str(path)))
    reference = load_model(str(path)).model
    held = [m for _, m in engine.runner.model.named_modules() if isinstance(m, (TransposedLinear, TransposedEmbedding))]
    assert not any(type(m) in (nn.Linear, nn.Embedding) for _, m in engine.runner.model.named_modules())
    assert engine.runner.flat
    prompt = [3, 14, 15, 92, 65, 35]
    out, flat = decode_graphs(tmp_path, engine, prompt, 6)
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(mx.argmax(reference(mx.array(tokens)[None])[0, -1]).item())
    assert out == tokens[len(prompt):]
    # The same engine on the packed [1, T, hidden] stream: per layer a reshape into the batch, one out of the
    # output projection and one into the joined gate/up more.
    layers = len(engine.runner.model.layers)
    engine.runner.flat = False
    again, packed = decode_graphs(tmp_path, engine, prompt, 6)
    assert again == out
    assert all(p["Reshape"] - f["Reshape"] >= 3 * layers for p, f in zip(packed, flat)), (packed, flat)
    # And with mlx's own linears back: a Transpose node more for every linear called (4 a layer and the tied
    # head; the attention's own transposes are in both).
    for module in held:
        module.__class__ = nn.Embedding if isinstance(module, TransposedEmbedding) else nn.Linear
    plain_out, plain = decode_graphs(tmp_path, engine, prompt, 6)
    assert plain_out == out
    assert len(held) == 4 * layers + 1
    assert all(p["Transpose"] - h["Transpose"] == len(held) for p, h in zip(plain, packed)), (plain, packed)
