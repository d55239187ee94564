"""The q/k/v kernel of the CUDA route (``engined.kernels.qk_rope``): which attention layers take it, and that a
layer taking it gives the engine's outputs when the kernel keeps its contract.

The kernel runs only on an NVIDIA GPU, where ``bench/kernels/qk_rope_check.py`` checks it against MLX's
operations. Here the CUDA route runs with the kernel's contract in MLX's operations (the split, reshapes, norms,
RoPE and squeezes the layer builds otherwise) and the reference attention in place of the CUDA attention, so
that the layer's wiring around the kernel (positions in, q to the attention, k and v to the pool) is what is
tested.
"""

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes

from mlxd.engined.engine import Engine
from mlxd.engined.kernels import gpu, paged_kv, qk_rope
from mlxd.engined.loaders import load_model
from mlxd.engined.model_layers import read_layers, transformer_layers
from mlxd.engined.runner import install
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import fresh_seed, make_tiny_model, tiny_config

# Heads of 64: the kernel takes whole heads in pairs of 32-lane halves.
WIDE = dict(head_dim=64)


def _attentions(arch: str, backend: str = "cuda", **overrides) -> list:
    config = tiny_config(arch, **{**WIDE, **overrides})
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    install(model, read_layers(model), backend)
    return [layer.self_attn for layer in transformer_layers(model)]


@pytest.mark.parametrize("arch,norm", [("llama", False), ("mistral", False), ("qwen3", True)])
def test_layers_of_the_kernels_form_take_it_on_cuda_only(arch, norm):
    layers = _attentions(arch)
    assert layers and all(a._qk_rope is not None for a in layers)
    assert all((a._qk_rope.eps is not None) == norm for a in layers)
    assert all(a._qk_rope is None for a in _attentions(arch, backend="reference"))


@pytest.mark.parametrize("arch,overrides", [
    ("gemma3_text", {}),  # Gemma's norms scale by 1 + weight: not nn.RMSNorm
    ("olmo2", {}),  # one norm over all heads' queries
    ("glm4", {}),  # RoPE over part of each head
    ("llama", {"rope_traditional": True}),  # interleaved pairs
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("qwen3", {"head_dim": 16}),
], ids=["gemma3", "olmo2", "glm4", "interleaved", "llama3-rope", "head-16"])
def test_other_forms_keep_mlx_operations(arch, overrides):
    layers = _attentions(arch, **overrides)
    assert layers and all(a._qk_rope is None for a in layers)


def _contract_kernel(dtype, heads, kv_heads, head_dim, base, scale, eps):
    """``qk_rope._kernel``'s launch, computed with the operations the layer builds without it."""
    import mlx.nn as nn

    rope = nn.RoPE(head_dim, base=base, scale=scale)

    def launch(inputs, output_shapes, **_):
        qkv, positions = inputs[:2]
        t = qkv.shape[0]
        q, k, v = mx.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
        q, k = q.reshape(t, heads, 1, head_dim), k.reshape(t, kv_heads, 1, head_dim)
        if eps is not None:
            q, k = mx.fast.rms_norm(q, inputs[2], eps), mx.fast.rms_norm(k, inputs[3], eps)
        outs = [rope(q, offset=positions).squeeze(2), rope(k, offset=positions).squeeze(2),
                v.reshape(t, kv_heads, head_dim)]
        assert [tuple(o.shape) for o in outs] == [tuple(s) for s in output_shapes]
        return outs

    return launch


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_cuda_routes_layer_around_the_kernel_gives_the_reference_routes_outputs(tmp_path, monkeypatch, arch):
    monkeypatch.setattr(qk_rope, "_kernel", _contract_kernel)
    monkeypatch.setattr(gpu, "attention", lambda dialect, *args: paged_kv.reference_attention(*args))
    model_dir = make_tiny_model(tmp_path / arch, arch, seed=fresh_seed(f"qk rope {arch}") % (1 << 30), **WIDE)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("cuda", "reference"):
        config = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=32, max_num_seqs=4,
                              attention_backend=backend)
        engine = Engine(config, load_model(str(model_dir)))
        taken = [a._qk_rope is not None for a in (layer.self_attn for layer in transformer_layers(engine.loaded.model))]
        assert all(taken) if backend == "cuda" else not any(taken)
        outputs[backend] = engine.generate(prompts, params)
    assert outputs["cuda"] == outputs["reference"]
