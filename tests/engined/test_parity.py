"""The packed paged step computes what mlx_lm's own forward computes.

One step mixes a decode row (context already cached), a middle chunk of a long
prefill (part of its prompt cached, part new) and a fresh prefill; each
request's last-row logits must equal mlx_lm's dense forward over the same
tokens. Float32 weights on the CPU backend: tolerance 2e-4 of the logits'
scale (observed ~1e-6).
"""

import mlx.core as mx
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.engined.request import Request
from mlxd.engined.scheduler import SchedulerOutput
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import ARCHS, fresh_seed, make_tiny_model, seeded_rng

REL_TOL = 2e-4


def run_mixed_step(engine: Engine, reqs_and_steps):
    """Drive the runner through explicit steps; returns the logits of the final mixed step."""
    kv, runner = engine.scheduler.kv, engine.runner
    logits = None
    for batch in reqs_and_steps:
        for req, n in batch:
            assert kv.allocate(req, n)
        logits = runner.run(SchedulerOutput(batch), [1] * len(batch))
        mx.eval(logits, kv.arrays())
        for req, n in batch:
            req.num_computed_tokens += n
    return logits


def check_parity(loaded, reference_model, vocab, block_size):
    engine = Engine(EngineConfig(num_kv_blocks=64, block_size=block_size), loaded=loaded)
    rng = seeded_rng()
    params = SamplingParams(temperature=0.0)
    toks = {name: rng.integers(0, vocab, size=n).tolist() for name, n in (("a", 21), ("b", 45), ("c", 11))}
    a = Request("a", toks["a"], params, 0)
    b = Request("b", toks["b"], params, 0)
    c = Request("c", toks["c"], params, 0)
    # Step 1 caches a's first 20 tokens and b's first 24 (non-contiguous blocks:
    # they are allocated interleaved); step 2 is the mixed batch.
    logits = run_mixed_step(engine, [[(a, 20), (b, 24)], [(a, 1), (b, 16), (c, 11)]])
    expected = [toks["a"], toks["b"][:40], toks["c"]]
    for row, tokens in enumerate(expected):
        ref = reference_model(mx.array(tokens)[None])[0, -1]
        err = mx.abs(logits[row] - ref).max().item()
        scale = mx.abs(ref).max().item()
        assert err <= REL_TOL * scale, f"row {row}: max error {err:.3g} vs scale {scale:.3g}"
    return engine


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_tiny_random_models(arch, tmp_path):
    path = make_tiny_model(tmp_path / arch, arch, seed=fresh_seed(f"{arch} model"))
    reference = load_model(str(path)).model
    check_parity(load_model(str(path)), reference, vocab=272, block_size=8)


def test_parity_smollm2_gguf():
    reference = load_model("").model
    check_parity(load_model(""), reference, vocab=49152, block_size=16)


@pytest.mark.parametrize("bits", [None, 4], ids=["float", "4-bit"])
def test_q_k_v_and_gate_up_run_as_one_projection_each_with_mlx_lm_s_logits(bits, tmp_path):
    """The runner joins q/k/v into one linear (plain or quantized alike, a bias too: qwen2's), and each MLP's
    gate/up into another that both members read their slices of; the packed step still computes mlx_lm's
    logits over the projections apart."""
    from tests.tiny_models import quantize_in_groups_of_32

    path = make_tiny_model(tmp_path / "qwen2", "qwen2", seed=fresh_seed("qwen2 model"))
    loaded, reference = load_model(str(path)), load_model(str(path)).model
    if bits:
        quantize_in_groups_of_32(loaded.model, bits)
        quantize_in_groups_of_32(reference, bits)
    engine = check_parity(loaded, reference, vocab=272, block_size=8)
    for layer in engine.runner.model.layers:
        attn = layer.self_attn
        assert "qkv_proj" in attn and "q_proj" not in attn and "bias" in attn.qkv_proj
        # A plain linear holds its weight's transpose (engined.runner.hold_transposes).
        assert type(attn.qkv_proj).__name__ == ("QuantizedLinear" if bits else "TransposedLinear")
        gate, up = layer.mlp.gate_proj, layer.mlp.up_proj
        assert type(gate).__name__ == type(up).__name__ == "JoinedMember" and gate.joined is up.joined
        assert type(gate.linear).__name__ == ("QuantizedLinear" if bits else "TransposedLinear") and "linear" not in up
