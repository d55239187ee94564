"""LoRA adapters through the packed step: one batch mixes adapter A, adapter B and the base model exactly.

Per family (llama dense and 4-bit, qwen3, qwen3_moe with its experts adapted):
two random adapters written by the test, A in mlx_lm's format and B in PEFT's;
the logits of one packed step holding an A, a B and a base request equal
mlx_lm's own forward of the model with that adapter loaded by mlx_lm
(``load_adapters``) and fused by mlx_lm's ``fuse``; greedy outputs of the
mixed batch equal each request run alone, also when ``--max-loras 1`` makes
the adapters take turns in one slot.
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.tuner.utils import load_adapters

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.engined.lora.adapters import read_adapter
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError, NotFoundError
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import fresh_seed, make_tiny_model, quantize_in_groups_of_32

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
EXPERTS = ("mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj")


def _module_shapes(model: nn.Module) -> dict[str, tuple]:
    """(in, out[, experts]) of every module an adapter of this test touches, by mlx_lm path."""
    out = {}
    for i, layer in enumerate(model.layers):
        for key in ATTN + DENSE_MLP + EXPERTS:
            obj = layer
            try:
                for part in key.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            w = obj.weight
            d_out, d_in = w.shape[-2:]
            if "scales" in obj:
                d_in = d_in * 32 // obj.bits
            out[f"model.layers.{i}.{key}"] = (d_in, d_out, w.shape[0] if w.ndim == 3 else None)
    return out


def random_adapter(model: nn.Module, rank: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """mlx_lm-shaped LoRA pairs for every attention, MLP and expert projection: lora_a, lora_b."""
    pairs = {}
    for path, (d_in, d_out, experts) in _module_shapes(model).items():
        if experts is None:
            pairs[path] = (rng.normal(0, 0.2, (d_in, rank)), rng.normal(0, 0.2, (rank, d_out)))
        else:
            pairs[path] = (rng.normal(0, 0.2, (experts, rank, d_in)), rng.normal(0, 0.2, (experts, d_out, rank)))
    return {k: (a.astype(np.float32), b.astype(np.float32)) for k, (a, b) in pairs.items()}


def write_mlx_lm(directory, pairs, scale: float, num_layers: int):
    directory.mkdir(parents=True)
    keys = sorted({p.split(".", 3)[3] for p in pairs})
    config = {"fine_tune_type": "lora", "num_layers": num_layers,
              "lora_parameters": {"rank": max(a.shape[-1] if a.ndim == 2 else a.shape[1] for a, _ in pairs.values()),
                                  "scale": scale, "dropout": 0.0, "keys": keys}}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for path, (a, b) in pairs.items():
        tensors[f"{path}.lora_a"], tensors[f"{path}.lora_b"] = mx.array(a), mx.array(b)
    mx.save_safetensors(str(directory / "adapters.safetensors"), tensors)
    return directory


def write_peft(directory, pairs, alpha: float, rank: int):
    """The same pairs as a PEFT adapter: lora_A [r, in], lora_B [out, r]; experts one module each."""
    directory.mkdir(parents=True)
    tensors = {}
    for path, (a, b) in pairs.items():
        if a.ndim == 2:
            tensors[f"base_model.model.{path}.lora_A.weight"] = mx.array(a.T)
            tensors[f"base_model.model.{path}.lora_B.weight"] = mx.array(b.T)
        else:
            moe, proj = path.rsplit(".switch_mlp.", 1)
            for e in range(a.shape[0]):
                tensors[f"base_model.model.{moe}.experts.{e}.{proj}.lora_A.weight"] = mx.array(a[e])
                tensors[f"base_model.model.{moe}.experts.{e}.{proj}.lora_B.weight"] = mx.array(b[e])
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
              "target_modules": sorted({p.rsplit(".", 1)[1] for p in pairs})}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "adapter_model.safetensors"), tensors)
    return directory


def _load(path, weights):
    loaded = load_model(str(path))
    if weights == "4-bit":
        quantize_in_groups_of_32(loaded.model)
    return loaded


def fused_reference(model_dir, weights, mlx_lm_adapter_dir):
    """mlx_lm's own model with the adapter loaded by mlx_lm and fused by its LoRA layers' ``fuse``."""
    model = _load(model_dir, weights).model
    load_adapters(model, str(mlx_lm_adapter_dir))
    fused = [(n, m.fuse(dequantize=True)) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused))
    return model


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    made = {}

    def get(arch, weights="float32"):
        if (arch, weights) not in made:
            seed = fresh_seed(f"{arch} {weights}")
            rng = np.random.default_rng(seed)
            where = root / f"{arch}-{weights}"
            model_dir = make_tiny_model(where / "model", arch, seed=seed % (1 << 30))
            model = _load(model_dir, weights).model
            a_pairs, b_pairs = random_adapter(model, 4, rng), random_adapter(model, 8, rng)
            a_dir = write_mlx_lm(where / "a-mlx", a_pairs, scale=2.0, num_layers=len(model.layers))
            b_dir = write_peft(where / "b-peft", b_pairs, alpha=16.0, rank=8)
            # B's reference: the same weights as mlx_lm writes them, scale alpha / r.
            b_ref = write_mlx_lm(where / "b-as-mlx", b_pairs, scale=16.0 / 8, num_layers=len(model.layers))
            made[arch, weights] = (model_dir, a_dir, b_dir, b_ref)
        return made[arch, weights]

    return get


def _engine(model_dir, weights, a_dir, b_dir, max_loras=2, **kw):
    config = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=256, max_num_seqs=8,
                          enable_lora=True, max_loras=max_loras, max_lora_rank=8,
                          lora_modules=[f"A={a_dir}", json.dumps({"name": "B", "path": str(b_dir)})], **kw)
    return Engine(config, _load(model_dir, weights))


CASES = [("llama", "float32"), ("llama", "4-bit"), ("qwen3", "float32"), ("qwen3_moe", "float32")]


@pytest.mark.parametrize("arch,weights", CASES)
def test_mixed_step_of_two_adapters_and_base_equals_mlx_lm_fused_forward(setups, arch, weights):
    model_dir, a_dir, b_dir, b_ref = setups(arch, weights)
    engine = _engine(model_dir, weights, a_dir, b_dir)
    rng = np.random.default_rng(fresh_seed("prompts"))
    # Long enough (3 x 30 tokens x 2 experts >= 64 routed rows) for mlx_lm's sorted expert path.
    prompts = [rng.integers(0, 256, 30).tolist() for _ in range(3)]
    for i, (prompt, lora) in enumerate(zip(prompts, ["A", "B", None])):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1), lora_name=lora)
    batch = engine.scheduler.schedule()
    assert [n for _, n in batch.scheduled] == [30, 30, 30]
    assert sorted(r.lora_slot for r, _ in batch.scheduled) == [0, 1, 2]
    logits = engine.runner.run(batch, num_logits=[30, 30, 30])
    mx.eval(logits)
    base = _load(model_dir, weights).model
    refs = [fused_reference(model_dir, weights, a_dir), fused_reference(model_dir, weights, b_ref), base]
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        want = ref(mx.array(prompt)[None])[0]
        got = logits[30 * i: 30 * (i + 1)]
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-3 if weights == "4-bit" else 2e-4,
                                   rtol=1e-3, err_msg=f"request {i} ({['A', 'B', 'base'][i]})")
    # The adapters really change the model: A's logits are not the base's.
    assert not np.allclose(np.array(logits[:30]), np.array(base(mx.array(prompts[0])[None])[0]), atol=1e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_an_adapter_of_q_and_v_only_beside_a_full_one_equals_mlx_lm_fused_forward(setups, arch, tmp_path):
    """PEFT's common target_modules ["q_proj", "v_proj"]: k's columns of the shared q/k/v product are zero for
    it, and o_proj, the MLP and the experts, which only A targets, still take A's rows' terms."""
    model_dir, a_dir, _, _ = setups(arch)
    base = _load(model_dir, "float32").model
    rng = np.random.default_rng(fresh_seed("q/v adapter"))
    pairs = {k: v for k, v in random_adapter(base, 8, rng).items() if k.endswith(("q_proj", "v_proj"))}
    c_dir = write_peft(tmp_path / "c-peft", pairs, alpha=8.0, rank=8)
    c_ref = write_mlx_lm(tmp_path / "c-as-mlx", pairs, scale=1.0, num_layers=len(base.layers))
    engine = _engine(model_dir, "float32", a_dir, c_dir)  # served as "A" and "B"
    prompts = [rng.integers(0, 256, 30).tolist() for _ in range(3)]
    for i, (prompt, lora) in enumerate(zip(prompts, ["B", None, "A"])):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1), lora_name=lora)
    batch = engine.scheduler.schedule()
    logits = engine.runner.run(batch, num_logits=[30, 30, 30])
    mx.eval(logits)
    refs = [fused_reference(model_dir, "float32", c_ref), base, fused_reference(model_dir, "float32", a_dir)]
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        want = np.array(ref(mx.array(prompt)[None])[0])
        np.testing.assert_allclose(np.array(logits[30 * i: 30 * (i + 1)]), want, atol=2e-4, rtol=1e-3,
                                   err_msg=f"request {i} ({['q/v only', 'base', 'A'][i]})")
    assert not np.allclose(np.array(logits[:30]), np.array(base(mx.array(prompts[0])[None])[0]), atol=1e-2)


@pytest.mark.parametrize("arch,max_loras", [("llama", 2), ("qwen3_moe", 1)])
def test_greedy_outputs_of_a_mixed_batch_equal_single_runs(setups, arch, max_loras):
    """With one slot, A's and B's requests take turns (LRU eviction) and still equal their single runs."""
    model_dir, a_dir, b_dir, _ = setups(arch)
    engine = _engine(model_dir, "float32", a_dir, b_dir, max_loras=max_loras)
    rng = np.random.default_rng(fresh_seed("prompts"))
    prompts = [rng.integers(0, 256, int(rng.integers(5, 20))).tolist() for _ in range(6)]
    loras = ["A", "B", None, "B", "A", None]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    together = engine.generate(prompts, params, loras)
    alone = [engine.generate([p], params, [lora])[0] for p, lora in zip(prompts, loras)]
    assert together == alone
    assert together[0] != engine.generate([prompts[0]], params)[0] or together[1] != engine.generate(
        [prompts[1]], params)[0], "the adapters changed no output"


def test_prefix_cache_is_shared_within_an_adapter_never_across(setups):
    model_dir, a_dir, b_dir, _ = setups("llama")
    engine = _engine(model_dir, "float32", a_dir, b_dir)
    prompt = list(range(40))
    # Two tokens: a request's full blocks enter the cache when a step commits them, not when it finishes.
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def cached(rid, lora):
        engine.add_request(rid, prompt, params, lora_name=lora)
        while True:
            for out in engine.step():
                if out.request_id == rid and out.finish_reason:
                    return out.num_cached_tokens

    assert cached("a1", "A") == 0
    assert cached("a2", "A") == 32
    assert cached("b1", "B") == 0
    assert cached("base", None) == 0
    assert cached("b2", "B") == 32


def test_bad_adapters_and_names_are_refused_clearly(setups, tmp_path):
    model_dir, a_dir, b_dir, _ = setups("llama")
    engine = _engine(model_dir, "float32", a_dir, b_dir)
    with pytest.raises(NotFoundError, match="does not exist"):
        engine.add_request("x", [1, 2, 3], SamplingParams(), lora_name="C")
    with pytest.raises(NotFoundError, match="not a directory"):
        engine.load_lora("C", str(tmp_path / "missing"))
    with pytest.raises(InvalidRequestError, match="already loaded"):
        engine.load_lora("A", str(a_dir))
    with pytest.raises(InvalidRequestError, match="base model's name"):
        engine.load_lora(engine.info.served_model_name, str(a_dir))
    # Rank over --max-lora-rank, and a module shape the model does not have.
    big = random_adapter(load_model(str(model_dir)).model, 16, np.random.default_rng(0))
    with pytest.raises(InvalidRequestError, match="over --max-lora-rank 8"):
        engine.load_lora("C", str(write_mlx_lm(tmp_path / "big", big, 1.0, 2)))
    wrong = {"model.layers.0.self_attn.q_proj": (np.zeros((32, 4), np.float32), np.zeros((4, 64), np.float32))}
    with pytest.raises(InvalidRequestError, match="the model needs"):
        engine.load_lora("C", str(write_mlx_lm(tmp_path / "wrong", wrong, 1.0, 2)))
    nowhere = {"model.layers.0.self_attn.nope": (np.zeros((64, 4), np.float32), np.zeros((4, 64), np.float32))}
    with pytest.raises(InvalidRequestError, match="not a linear layer"):
        engine.load_lora("C", str(write_mlx_lm(tmp_path / "nowhere", nowhere, 1.0, 2)))
    assert [a.name for a in engine.info.lora_adapters] == ["A", "B"]


def test_runtime_load_and_unload(setups):
    model_dir, a_dir, b_dir, _ = setups("llama")
    engine = _engine(model_dir, "float32", a_dir, b_dir)
    engine.load_lora("A2", str(a_dir))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert engine.generate([[5, 6, 7]], params, ["A2"]) == engine.generate([[5, 6, 7]], params, ["A"])
    engine.add_request("busy", [1, 2, 3], params, lora_name="A2")
    with pytest.raises(InvalidRequestError, match="in use by 1 request"):
        engine.unload_lora("A2")
    engine.abort(["busy"])
    engine.unload_lora("A2")
    with pytest.raises(NotFoundError):
        engine.add_request("gone", [1, 2, 3], params, lora_name="A2")
    with pytest.raises(NotFoundError):
        engine.unload_lora("A2")


def test_peft_scale_and_expert_stacking_read_as_mlx_lm_would(setups):
    model_dir, _, b_dir, b_ref = setups("qwen3_moe")
    peft, ref = read_adapter(str(b_dir)), read_adapter(str(b_ref))
    assert peft.modules.keys() == ref.modules.keys()
    for path, (a, b) in ref.modules.items():
        np.testing.assert_allclose(peft.modules[path][0], a, rtol=1e-6)
        np.testing.assert_allclose(peft.modules[path][1], b, rtol=1e-6)


def test_lora_requests_info_has_vllms_labels_and_names_running_and_waiting_adapters(setups):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tests.engined.test_vllm_parity import VLLM

    model_dir, a_dir, b_dir, _ = setups("llama")
    # One slot: while A's request runs, B's waits for it.
    engine = _engine(model_dir, "float32", a_dir, b_dir, max_loras=1, metrics_prefix="vllm")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params, lora_name="A")
    engine.add_request("b", [4, 5, 6], params, lora_name="B")
    engine.step()

    def series():
        text = generate_latest(engine.metrics.registry).decode()
        fam = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info")
        assert fam.type == VLLM["lora_requests_info"]["type"]
        return [s.labels for s in fam.samples]

    assert series() == [{"max_lora": "1", "running_lora_adapters": "A", "waiting_lora_adapters": "B"}]
    assert set(series()[0]) == set(VLLM["lora_requests_info"]["labels"])
    while engine.has_unfinished():
        engine.step()
    assert series() == [{"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}]


def test_a_half_precision_base_runs_its_adapters_on_the_cpu(setups):
    """A bf16 model serves its adapters on the CPU (their dense terms in bf16; experts' in float32, what MLX's CPU
    gather_mm takes)."""
    model_dir, a_dir, b_dir, _ = setups("llama")
    loaded = _load(model_dir, "float32")
    loaded.model.set_dtype(mx.bfloat16)
    config = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=256, enable_lora=True,
                          max_loras=2, max_lora_rank=8, lora_modules=[f"A={a_dir}", f"B={b_dir}"])
    engine = Engine(config, loaded)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = engine.generate(prompts * 3, params, ["A", "A", "B", "B", None, None])
    assert out[0:2] != out[4:6] or out[2:4] != out[4:6]
