"""q/k/v (and gate/up) take one x·A product per input, and projections that no resident adapter targets add no
term: MLX's own ``gather_mm`` calls counted while one mixed packed step's graph is built (that its logits equal
mlx_lm's fused forward is test_lora's)."""

import mlx.core as mx
import numpy as np
import pytest

from engined.lora.adapters import read_adapter
from shared.protocol import SamplingParams
from tests.engined.test_lora import _engine, _load, random_adapter, setups, write_mlx_lm  # noqa: F401 (setups)
from tests.tiny_models import fresh_seed


# Per llama layer, every projection adapted: q/k/v one A product and three B, o two, gate/up one and two,
# down two (separate products: 14). Only q and v adapted: one A product and two B.
@pytest.mark.parametrize("suffixes,per_layer", [(None, 11), (("q_proj", "v_proj"), 3)], ids=["all", "q_v"])
def test_one_mixed_step_runs_one_a_product_per_shared_input(setups, tmp_path, monkeypatch, suffixes, per_layer):
    model_dir, a_dir, b_dir, _ = setups("llama")
    if suffixes:
        base = _load(model_dir, "float32").model
        rng = np.random.default_rng(fresh_seed("q/v adapters"))
        dirs = []
        for name in ("a", "b"):
            pairs = {k: v for k, v in random_adapter(base, 4, rng).items() if k.endswith(suffixes)}
            dirs.append(write_mlx_lm(tmp_path / name, pairs, scale=1.0, num_layers=len(base.layers)))
        a_dir, b_dir = dirs
    engine = _engine(model_dir, "float32", a_dir, b_dir)
    for i, lora in enumerate(["A", None, "B"]):
        engine.add_request(f"r{i}", [3, 4, 5, 6], SamplingParams(max_tokens=1), lora_name=lora)
    calls, gather_mm = [], mx.gather_mm

    def counted(*args, **kw):
        calls.append(args[1].shape)
        return gather_mm(*args, **kw)

    monkeypatch.setattr(mx, "gather_mm", counted)
    logits = engine.runner.run(engine.scheduler.schedule())
    monkeypatch.undo()
    mx.eval(logits)
    assert len(calls) == per_layer * len(engine.runner.model.layers), calls


def test_a_projection_called_on_another_input_gets_its_own_product(setups):
    """The shared product belongs to the array it was made from: k_proj called on another one (a model that
    feeds its projections apart) still gets its own x·A, and v_proj, back on q's input, too."""
    model_dir, a_dir, b_dir, _ = setups("llama")
    engine = _engine(model_dir, "float32", a_dir, b_dir)
    slot = engine.lora.acquire("A")
    pairs = read_adapter(str(a_dir)).modules
    attn = engine.runner.model.layers[0].self_attn
    rng = np.random.default_rng(fresh_seed("inputs"))
    x1, x2 = (mx.array(rng.normal(size=(1, 3, attn.q_proj.input_dims)).astype(np.float32)) for _ in range(2))
    calls = (("q_proj", x1), ("k_proj", x2), ("v_proj", x1))
    engine.lora.set_step([slot], [3])
    try:
        got = [getattr(attn, name)(x) for name, x in calls]
    finally:
        engine.lora.set_step([], [])
    for (name, x), out in zip(calls, got):
        a, b = pairs[f"model.layers.0.self_attn.{name}"]
        want = np.array(getattr(attn, name).linear(x)) + np.array(x) @ a @ b
        np.testing.assert_allclose(np.array(out), want, rtol=1e-4, atol=1e-4, err_msg=name)
