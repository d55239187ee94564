"""Every family of the model-support matrix runs through the packed paged step exactly.

Per family (``tests/model_support.py``): a tiny random-weight model built from
mlx_lm's own classes; the mixed step of ``test_parity`` (decode row, middle
prefill chunk, fresh prefill) must give mlx_lm's own forward logits, with
float32 and with 4-bit weights; greedy outputs must be the same with prefix
caching on and off while the cache hits, and with n-gram speculation on and
off while drafts are made. The README table is rendered from the
same matrix and must be current, and every mlx_lm model type outside it is
refused from its config.json alone, in one line.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from mlxd.engined import model_layers
from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ModelLoadError
from mlxd.shared.protocol import SamplingParams
from tests import model_support
from tests.engined.test_parity import check_parity
from tests.tiny_models import make_tiny_model, quantize_in_groups_of_32, seeded_rng, tiny_config

FAMILIES = {f.arch: f for f in model_support.FAMILIES}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(arch):
        if arch not in made:
            seed = np.random.randint(1 << 30)
            print(f"{arch}: model seed {seed}")
            made[arch] = make_tiny_model(root / arch, arch, seed=seed)
        return made[arch]

    return get


def _load(path, weights):
    loaded = load_model(str(path))
    if weights == "4-bit":
        quantize_in_groups_of_32(loaded.model)
    return loaded


@pytest.mark.parametrize("arch,weights", [(f.arch, w) for f in model_support.FAMILIES for w in f.weights])
def test_family_mixed_step_matches_mlx_lm_forward(tiny_dirs, arch, weights):
    path = tiny_dirs(arch)
    check_parity(_load(path, weights), _load(path, weights).model, vocab=272, block_size=8)


@pytest.mark.parametrize("arch", [f.arch for f in model_support.FAMILIES if f.prefix_caching])
def test_family_outputs_equal_with_prefix_caching_on_and_off(tiny_dirs, arch):
    rng = seeded_rng()
    shared = rng.integers(0, 256, size=29).tolist()
    first = [shared + rng.integers(0, 256, size=5).tolist()]
    second = [shared + rng.integers(0, 256, size=n).tolist() for n in (3, 11)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        # Chunks of 12 tokens: prefills cross block boundaries mid-chunk, and windowed layers
        # see context that is partly cached, partly new.
        config = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=12,
                              enable_prefix_caching=caching)
        engine = Engine(config, loaded=load_model(str(tiny_dirs(arch))))
        results[caching] = (engine.generate(first, params), engine.generate(second, params))
        if caching:
            assert engine.stats().prefix_cache_hits >= 2 * 24  # both second-round prompts reuse 3 blocks
        engine.scheduler.kv.pool.check_whole()
    assert results[True] == results[False]


def _counter(engine, name):
    return sum(s.value for m in engine.metrics.registry.collect() for s in m.samples if s.name.endswith(name))


@pytest.mark.parametrize("arch", [f.arch for f in model_support.FAMILIES if f.speculative])
def test_family_greedy_outputs_equal_with_ngram_speculation_on_and_off(tiny_dirs, arch):
    seed = np.random.SeedSequence().entropy
    print(f"prompt seed {seed}")
    rng = np.random.default_rng(seed)
    # Every token of the vocabulary occurs in each prompt, so with n-grams from 1 token the
    # proposer drafts at every decode step; the repeats give longer matches too.
    motif = rng.integers(0, 256, size=7).tolist()
    prompts = [rng.permutation(272).tolist() + motif * 3, motif * 2 + rng.permutation(272).tolist()]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = []
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    for spec in (None, ngram):
        config = EngineConfig(num_kv_blocks=128, block_size=8, speculative_config=spec)
        engine = Engine(config, loaded=load_model(str(tiny_dirs(arch))))
        outputs.append(engine.generate(prompts, params))
    assert _counter(engine, "spec_decode_num_draft_tokens_total") > 0
    assert outputs[0] == outputs[1], outputs


def test_layer_settings_read_from_each_layer():
    """Windows, scales and sinks come from the layer's own module, not from a per-family table."""
    from tests.tiny_models import tiny_config
    from mlx_lm.utils import _get_classes

    def settings(arch):
        config = tiny_config(arch)
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        return [model_layers.layer_settings(model, i, layer, layer.self_attn) for i, layer in enumerate(model.layers)]

    gemma = settings("gemma3_text")
    assert [s.sliding_window for s in gemma] == [12, None]
    assert all(s.scale == pytest.approx(24 ** -0.5) and not s.has_sinks for s in gemma)
    oss = settings("gpt_oss")
    assert [s.sliding_window for s in oss] == [12, None]
    assert all(s.has_sinks and s.scale == pytest.approx(16 ** -0.5) for s in oss)
    assert [s.sliding_window for s in settings("qwen3_moe")] == [None, None]


def _tiny_model(arch):
    from mlx_lm.utils import _get_classes

    from tests.tiny_models import tiny_config

    config = tiny_config(arch)
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def test_a_layer_whose_attention_kind_cannot_be_read_is_refused():
    """Never silently full attention: a declared window no layer claims, or an unknown layer type."""
    gemma = _tiny_model("gemma3_text")
    for layer in gemma.model.layers:
        del layer.self_attn.is_sliding  # a family spelling the per-layer flag some other way
    with pytest.raises(ModelLoadError, match="sliding window of 12 but no layer says whether it slides"):
        model_layers.read_layers(gemma)
    oss = _tiny_model("gpt_oss")
    oss.model.layer_types = ["chunked_attention"] + list(oss.model.layer_types[1:])
    with pytest.raises(ModelLoadError, match="'chunked_attention' is not supported"):
        model_layers.read_layers(oss)
    assert [s.sliding_window for s in model_layers.read_layers(_tiny_model("gpt_oss"))] == [12, None]


def test_a_rope_that_cannot_take_per_token_positions_is_refused():
    """Dynamic NTK scaling changes RoPE's base with the sequence length: no packed step can match it."""
    from mlx_lm.utils import _get_classes

    from tests.tiny_models import tiny_config

    config = tiny_config("llama", rope_scaling={"type": "dynamic", "factor": 2.0})
    model_class, args_class = _get_classes(config)
    with pytest.raises(ModelLoadError, match="layer 0: its RoPE .DynamicNTKScalingRoPE. cannot rotate"):
        model_layers.read_layers(model_class(args_class.from_dict(config)))


def test_readme_model_table_is_generated_from_the_matrix():
    text = model_support.README.read_text()
    assert model_support.section() in text, "README model table is stale: run `python -m tests.model_support`"
    for f in model_support.FAMILIES:
        assert f"`{f.config_type}`" in model_support.render()


def _mlx_lm_model_types() -> list[str]:
    """Every model_type mlx_lm can build: its model modules (those defining ``Model``) and its aliases.

    Read from the sources, not imported: importing 130 modules would dominate the test.
    """
    import mlx_lm.models
    from mlx_lm.utils import MODEL_REMAPPING

    folder = Path(mlx_lm.models.__file__).parent
    modules = [f.stem for f in folder.glob("*.py") if "\nclass Model(" in f.read_text()]
    return sorted(set(modules) | set(MODEL_REMAPPING))


def test_every_mlx_lm_model_type_outside_the_matrix_is_refused_in_one_line(tmp_path):
    """From config.json alone (no weights in the directory): one line naming the type and the supported list."""
    tested = {f.config_type for f in model_support.FAMILIES}
    refused = [t for t in _mlx_lm_model_types() if t not in tested]
    assert len(refused) > 80 and "deepseek_v3" in refused and "llama" not in refused
    (tmp_path / "config.json").write_text("{}")
    for model_type in refused:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 64}))
        with pytest.raises(ModelLoadError) as e:
            load_model(str(tmp_path))
        message = str(e.value)
        assert "\n" not in message and f"model_type {model_type!r} is not supported" in message, message
        assert "supported: gemma2, gemma3, " in message, message


def test_a_wrapper_around_an_untested_text_model_is_refused(tmp_path):
    config = {"model_type": "mistral3", "text_config": {"model_type": "mistral4", "hidden_size": 64}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'mistral3' wrapping text model_type 'mistral4' is not supported"):
        load_model(str(tmp_path))


def test_the_allow_list_is_the_tested_matrix():
    """A model type loads only if a row of the matrix proves it, and each row's wrapping is allowed."""
    assert set(model_layers.SUPPORTED) == {f.config_type for f in model_support.FAMILIES}
    wrappings = {(f.config_type, f.text_model_type) for f in model_support.FAMILIES if f.text_model_type}
    assert wrappings == {(outer, inner) for outer, inners in model_layers.SUPPORTED.items() for inner in inners}
    for f in model_support.FAMILIES:
        config = tiny_config(f.arch)
        assert (config["model_type"], config.get("text_config", {}).get("model_type", "")) == (
            f.config_type, f.text_model_type)
        model_layers.check_model_type(config)


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4"])
def test_gemma4_shared_layers_read_their_source_layers_pool_entry(tiny_dirs, arch):
    """Layers 2 and 3 read layers 0 and 1's K/V: one pool entry each (billed once), not a copy."""
    loaded = load_model(str(tiny_dirs(arch)))
    specs = model_layers.read_layers(loaded.model)
    assert [s.kv_source for s in specs] == [None, None, 0, 1]
    assert [s.sliding_window for s in specs] == [12, None, 12, None]
    assert [s.settings.head_dim for s in specs] == [16, 32, 16, 32]  # global layers have their own head size
    engine = Engine(EngineConfig(num_kv_blocks=16, block_size=8), loaded=loaded)
    kv = engine.scheduler.kv
    window, full = kv.groups[1], kv.main
    assert (window.layers, full.layers) == ([0, 2], [1, 3])
    assert (window.kv.layers, full.kv.layers) == ([0], [1])  # arrays for the sources alone
    assert len(kv.arrays()) == 4
    k_heads = 1 if arch == "gemma4_text" else 2  # 26B/31B global layers: fewer K/V heads (K = V)
    assert full.bytes_per_block == 2 * 8 * k_heads * 32 * 4
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    req = engine.generate([list(range(20))], params)
    caches = kv.step_caches([])
    assert caches[2] is caches[0] and caches[3] is caches[1] and caches[0] is not caches[1]
    assert len(req[0]) == 3


def test_a_supported_type_whose_config_lacks_a_field_is_refused_in_one_line(tmp_path):
    path = make_tiny_model(tmp_path / "m", "ministral3")
    config = json.loads((path / "config.json").read_text())
    del config["rope_parameters"]["llama_4_scaling_beta"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    assert "does not describe an mlx_lm 'ministral3' model (KeyError: 'llama_4_scaling_beta')" in str(e.value)
    assert "\n" not in str(e.value)


# One of each kind of layer and stream the compiled decode step must trace: plain full attention (flat
# stream), windowed layers with their own group and q/k norms, K/V shared between layers with per-layer
# inputs, position-scaled queries on the packed stream, experts, sinks; and a hybrid, whose recurrent
# slots are never traced.
COMPILED_FAMILIES = ("llama", "gemma3_text", "gemma4", "ministral3", "qwen3_moe", "gpt_oss", "qwen3_next")


@pytest.mark.parametrize("arch", COMPILED_FAMILIES)
def test_family_greedy_outputs_equal_with_decode_steps_compiled_and_built(tiny_dirs, arch):
    rng = seeded_rng()
    # Contexts from 9 to ~150 tokens: tables of 8-token blocks cross their 8-block padding, requests
    # finish at different steps, so the batch's shapes change and new traces are made mid-run.
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (9, 40, 70)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (80, 30, 55)]
    outputs, compiled = [], None
    for on in (False, True):
        config = EngineConfig(num_kv_blocks=96, block_size=8, attention_backend="reference", compile_decode=on)
        engine = Engine(config, loaded=load_model(str(tiny_dirs(arch))))
        outputs.append(engine.generate(prompts, params))
        compiled = engine.runner.compiled
    if arch == "qwen3_next":
        assert compiled.calls == 0
    else:
        assert compiled.traces >= 3 and compiled.calls >= compiled.traces + 50, (compiled.traces, compiled.calls)
    assert outputs[0] == outputs[1]
