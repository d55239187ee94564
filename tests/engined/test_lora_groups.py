"""q/k/v (and gate/up) run as one group: one x·A product and one B product per input, and groups that no resident
adapter targets add no term: MLX's own ``matmul`` (the x·A products) and ``addmm`` (each group's B, added to its
output) calls counted while one mixed packed step's graph is built, and no ``gather_mm`` (that its logits equal
mlx_lm's fused forward is test_lora's)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxd.engined.lora.adapters import read_adapter
from mlxd.shared.protocol import SamplingParams
from tests.engined.test_lora import _engine, _load, random_adapter, setups, write_mlx_lm  # noqa: F401 (setups)
from tests.tiny_models import fresh_seed


def _llama_engine(setups, tmp_path, suffixes, weights="float32"):
    """A LoRA engine on the tiny llama with adapters A and B of every projection, or (``suffixes``) of those
    projections only."""
    model_dir, a_dir, b_dir, _ = setups("llama", weights)
    if suffixes:
        base = _load(model_dir, weights).model
        rng = np.random.default_rng(fresh_seed(f"adapters of {suffixes}"))
        dirs = []
        for name in ("a", "b"):
            pairs = {k: v for k, v in random_adapter(base, 4, rng).items() if k.endswith(suffixes)}
            dirs.append(write_mlx_lm(tmp_path / name, pairs, scale=1.0, num_layers=len(base.layers)))
        a_dir, b_dir = dirs
    return _engine(model_dir, weights, a_dir, b_dir)


# Per llama layer, every projection adapted: one B product for each group (q/k/v, o, gate/up, down; apart,
# 7), and one x·A product for each where the base is quantized; a plain base's own matmul gives x·A (A's
# columns are its weight's last rows), so there are none. Only q and v adapted: the q/k/v group's alone.
@pytest.mark.parametrize("suffixes,weights,a_products,b_products", [
    (None, "float32", 0, 4), (None, "4-bit", 4, 4), (("q_proj", "v_proj"), "float32", 0, 1),
    (("q_proj", "v_proj"), "4-bit", 1, 1)], ids=["all", "all-4-bit", "q_v", "q_v-4-bit"])
def test_one_mixed_step_runs_one_b_product_per_group(setups, tmp_path, monkeypatch, suffixes, weights, a_products,
                                                     b_products):
    engine = _llama_engine(setups, tmp_path, suffixes, weights)
    for i, lora in enumerate(["A", None, "B"]):
        engine.add_request(f"r{i}", [3, 4, 5, 6], SamplingParams(max_tokens=1), lora_name=lora)
    calls = {"matmul": [], "addmm": [], "gather_mm": []}

    def counting(name):
        real = getattr(mx, name)

        def counted(*args, **kw):
            calls[name].append(args[-1].shape)
            return real(*args, **kw)
        return counted

    for name in calls:
        monkeypatch.setattr(mx, name, counting(name))
    logits = engine.runner.run(engine.scheduler.schedule())
    monkeypatch.undo()
    mx.eval(logits)
    layers = len(engine.runner.model.layers)
    assert (len(calls["matmul"]), len(calls["addmm"])) == (a_products * layers, b_products * layers), calls
    assert not calls["gather_mm"]


def test_a_projection_called_on_another_input_gets_its_own_product(setups):
    """A group's output belongs to the array it was made from: k_proj called on another one (a model that
    feeds its projections apart) still gets its own, and v_proj, back on q's input, too."""
    model_dir, a_dir, b_dir, _ = setups("llama")
    engine = _engine(model_dir, "float32", a_dir, b_dir)
    base = _load(model_dir, "float32").model.layers[0].self_attn
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
        want = np.array(getattr(base, name)(x)) + np.array(x) @ a @ b
        # A group's outputs are [tokens, out] whatever the input's leading axes (runner.JoinedLinears).
        np.testing.assert_allclose(np.array(out), want.reshape(3, -1), rtol=1e-4, atol=1e-4, err_msg=name)


def _term_by_rows(y, h, h_offset, b, slots, width, out, glu=False, residual=None):
    """``engined.kernels.lora_term.add_term``'s contract, row by row in MLX (the kernel itself needs CUDA)."""
    cols = 2 * out if glu else out
    rows = []
    for t, s in enumerate(np.array(slots).tolist()):
        row = y[t, :cols]
        if s:
            c0 = h_offset + (s - 1) * width
            row = row + h[t, c0:c0 + width] @ b[(s - 1) * width:s * width, :cols]
        rows.append(nn.silu(row[:out]) * row[out:] if glu else row)
    return mx.stack(rows) if residual is None else residual + mx.stack(rows)


@pytest.mark.parametrize("weights", ["float32", "4-bit"])
def test_the_term_kernels_arguments_give_the_masked_terms_logits(setups, tmp_path, monkeypatch, weights):
    """Where attention runs on CUDA a decode step's groups hand their term to ``lora_term.add_term``: with that
    contract computed row by row, one mixed step (A, the base, B) has the logits of MLX's mask and addmm, for
    a folded group (x·A in the base output, read from its last columns) and a quantized one (x·A apart).
    ``python -m bench.lora --term`` checks the kernel against the same operations on a GPU."""
    from mlxd.engined.kernels import lora_term

    engine = _llama_engine(setups, tmp_path, None, weights)
    prompts = {"A": [3, 4, 5, 6], None: [7, 8, 9], "B": [10, 11]}
    for i, (lora, prompt) in enumerate(prompts.items()):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1), lora_name=lora)
    batch = engine.scheduler.schedule()
    want = engine.runner.run(batch)
    calls = []

    def term(*args):
        calls.append((args[7], args[8] is not None))
        return _term_by_rows(*args)

    monkeypatch.setattr(lora_term, "add_term", term)
    engine.lora.step.term_kernel = True
    got = engine.runner.run(batch)
    # (glu, residual) of q/k/v, o (with the block's residual), gate/up (with the MLP's activation) and down (with
    # the block's residual) of every layer
    assert calls == [(False, False), (False, True), (True, False), (False, True)] * len(engine.runner.model.layers)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


# One small layer's arguments, for the form checks below.
_ONE_LAYER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64, rms_norm_eps=1e-5)


def test_only_a_swiglu_mlp_takes_its_hidden_state_from_its_group():
    """An MLP whose output is ``down(swiglu(gate(x), up(x)))`` (llama's) is checked as such and may take its
    hidden state from its gate/up group in one piece; another activation (gemma's GELU) is not."""
    from mlx_lm.models import gemma, llama

    from mlxd.engined.lora.layers import _swiglu_form

    assert _swiglu_form(llama.MLP(llama.ModelArgs(model_type="llama", **_ONE_LAYER)))
    assert not _swiglu_form(gemma.MLP(32, 64))


def test_only_a_plain_residual_block_hands_its_additions_to_its_groups():
    """A decoder layer of llama's ``h = x + attn(norm(x)); h + mlp(norm(h))`` is checked as such (its o_proj's and
    down_proj's groups may then add the residual); gemma2's, which norms each branch's output first, is not."""
    from mlx_lm.models import gemma2, llama

    from mlxd.engined.lora.layers import _residual_form

    assert _residual_form(llama.TransformerBlock(llama.ModelArgs(model_type="llama", **_ONE_LAYER)))
    assert not _residual_form(gemma2.TransformerBlock(gemma2.ModelArgs(model_type="gemma2", head_dim=16, **_ONE_LAYER)))
