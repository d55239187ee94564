"""MTP speculation: the checkpoint's own MTP layer drafts, the target verifies.

Tiny random-weight Qwen3-Next / Qwen3.5 / Qwen3.5-MoE (hybrid) and GLM-4.5
(plain attention, DeepSeek-V3's MTP layout) checkpoints with an MTP layer
(``make_tiny_model(mtp=True)``). Outputs must not depend on the layer's
quality (greedy: identical; sampled: the same distribution); a layer trained
on the model's own continuations must be accepted often enough that the
target runs fewer forwards than it emits tokens.
"""

import json
import re
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from transformers import AutoTokenizer

from mlxd.engined.engine import Engine
from mlxd.engined.kv.mtp_layer import MTPLayerGroup
from mlxd.engined.loaders import load_model
from mlxd.engined.metrics import StatsLog
from mlxd.engined.model_layers import text_model
from mlxd.engined.speculation.mtp import build_layer
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ModelLoadError
from mlxd.shared.protocol import SamplingParams, StructuredSpec
from tests.engined.test_speculative import CHI2_999, chi2_two_sample, waits_per_draft_round
from tests.tiny_models import assert_greedy_equal_up_to_ties, make_tiny_model, seeded_rng

KW = dict(num_kv_blocks=256, block_size=8, max_num_seqs=8, max_num_batched_tokens=64)


def mtp_config(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


def spec_counts(engine: Engine) -> tuple[float, float]:
    return engine.metrics.spec_draft_tokens._value.get(), engine.metrics.spec_accepted._value.get()


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe", "glm4_moe"])
def family(request, tmp_path_factory):
    seed = np.random.randint(1 << 30)
    print(f"{request.param}: model seed {seed}")
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=seed, mtp=True)


def mixed_batch(rng) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy prompts of mixed lengths (one long enough for chunked prefill, one that opts out of
    speculation) and, last, two that share a 17-token prefix with the third."""
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in (5, 12, 23, 70)]  # 70: chunked prefill
    shared = prompts[2][:17]
    prompts += [shared + [3, 4, 5], shared + [9, 9]]
    params = [SamplingParams(max_tokens=int(rng.integers(6, 14)), temperature=0.0, ignore_eos=True,
                             speculate=i != 1) for i in range(len(prompts))]
    return prompts, params


def test_greedy_outputs_with_mtp_equal_plain_decoding_on_mixed_batches(family):
    rng = seeded_rng()
    plain = Engine(EngineConfig(**KW), loaded=load_model(str(family)))
    spec = Engine(EngineConfig(**KW, speculative_config=mtp_config(3)), loaded=load_model(str(family)))
    prompts, params = mixed_batch(rng)
    expected = plain.generate(prompts, params)
    assert spec.generate(prompts, params) == expected
    hits = spec.stats().prefix_cache_hits
    for i in (4, 5):  # 5 resumes from 4's cached prefix (K/V, a hybrid's state snapshot, MTP K/V)
        assert spec.generate([prompts[i]], params[i]) == [expected[i]]
    assert spec.stats().prefix_cache_hits >= hits + 16
    drafted, _ = spec_counts(spec)
    assert drafted > 0
    # The MTP layer's K/V are a group of the KV manager, billed per block of the main pool.
    kv = spec.scheduler.kv
    (group,) = [g for g in kv.groups if isinstance(g, MTPLayerGroup)]
    assert kv.bytes_per_block == plain.scheduler.kv.bytes_per_block + group.bytes_per_block > 0
    assert group.kv.num_blocks == kv.pool.num_resident
    spec.step()
    assert not spec.mtp.pending  # finished requests are forgotten at the next step
    kv.pool.check_whole()


def test_decode_steps_are_not_replayed_where_mtp_reads_the_target_s_hidden_states(family):
    """A replayed step runs none of the model's Python: the tap that hands MTP the hidden states would not run."""
    spec = Engine(EngineConfig(**KW, speculative_config=mtp_config(3), compile_decode=True),
                  loaded=load_model(str(family)))
    assert spec.runner.compiled is None
    plain = Engine(EngineConfig(**KW, compile_decode=True), loaded=load_model(str(family)))
    assert plain.runner.compiled is not None


def test_mtp_is_refused_for_a_checkpoint_without_mtp_layers(tmp_path):
    d = make_tiny_model(tmp_path / "m", "qwen3_5", seed=1)
    with pytest.raises(ModelLoadError, match="no MTP layer"):
        Engine(EngineConfig(**KW, speculative_config='{"num_speculative_tokens": 2}'), loaded=load_model(str(d)))


# -- a trained MTP layer: real acceptance ------------------------------------------------------------------

ACCEPTANCE_FLOOR = 0.5  # an untrained layer's drafts are accepted about 1 time in 272 (the vocabulary)


def train_mtp(model_dir, out_dir, prompts: list[list[int]], continuations: list[list[int]], steps: int):
    """Train the checkpoint's MTP layer to predict token t+2 from token t+1 and the model's hidden
    state at t on the model's own greedy continuations; write a checkpoint with the trained layer."""
    loaded = load_model(str(model_dir))
    layer, _ = build_layer(loaded.model, loaded.model_type, loaded.mtp)
    text = text_model(loaded.model)
    seqs = [p + c for p, c in zip(prompts, continuations)]
    length = min(len(s) for s in seqs)
    tokens = mx.array([s[:length] for s in seqs])
    hidden = mx.stop_gradient(text.model(tokens))  # the target's final normed hidden states [B, L, H]
    embeddings = mx.stop_gradient(text.model.embed_tokens(tokens[:, 1:-1]))
    targets = tokens[:, 2:]
    # Only the continuation's tokens are the model's to predict; the prompts are random.
    weight = mx.array([[float(t + 2 >= len(p)) for t in range(length - 2)] for p in prompts])

    def loss_fn(layer):
        out = layer(embeddings, hidden[:, :-2], "causal")
        ce = nn.losses.cross_entropy(text.lm_head(out), targets, reduction="none")
        return (ce * weight).sum() / weight.sum()

    opt = optim.Adam(learning_rate=1e-2)
    step = nn.value_and_grad(layer, loss_fn)
    for _ in range(steps):
        loss, grads = step(layer)
        opt.update(layer, grads)
        mx.eval(layer.parameters(), opt.state)
    shutil.copytree(model_dir, out_dir)
    weights = dict(mx.load(str(out_dir / "model.safetensors")))
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(layer.parameters())})
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    return loss.item()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Qwen3.5 whose MTP layer was trained on its greedy continuations of 8 prompts:
    (checkpoint, prompts, continuations)."""
    tmp = tmp_path_factory.mktemp("trained")
    rng = seeded_rng()
    d = make_tiny_model(tmp / "m", "qwen3_5", seed=int(rng.integers(1 << 30)), mtp=True)
    plain = Engine(EngineConfig(**KW), loaded=load_model(str(d)))
    prompts = [rng.integers(0, 256, size=6).tolist() for _ in range(8)]
    continuations = plain.generate(prompts, GREEDY_32)
    loss = train_mtp(d, tmp / "trained", prompts, continuations, steps=300)
    print(f"MTP training loss {loss:.3f}")
    return tmp / "trained", prompts, continuations


GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def test_a_trained_mtp_layer_is_accepted_and_saves_target_forwards(trained):
    path, prompts, continuations = trained
    spec = Engine(EngineConfig(**KW, speculative_config=mtp_config(2)), loaded=load_model(str(path)))
    stats_log = StatsLog(spec.metrics)
    stats_log.maybe_log(0.0, spec.stats(), 10.0)
    reference = load_model(str(path)).model  # mlx_lm's own forward, for the greedy choices
    assert_greedy_equal_up_to_ties(reference, prompts, spec.generate(prompts, GREEDY_32), continuations)
    drafted, accepted = spec_counts(spec)
    print(f"accepted {accepted:.0f} of {drafted:.0f} drafts")
    assert accepted / drafted > ACCEPTANCE_FLOOR
    # vLLM's SpecDecoding stats line: mean acceptance length counts the bonus token.
    line = stats_log.maybe_log(10.0, spec.stats(), 10.0).splitlines()[1]
    totals = spec.metrics.spec
    assert totals.draft_tokens == drafted and totals.accepted == accepted
    rates = ", ".join(f"{n / totals.drafts:.3f}" for n in totals.accepted_per_pos)
    assert line == (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / totals.drafts:.2f}, "
                    f"Accepted throughput: {accepted / 10:.2f} tokens/s, Drafted throughput: {drafted / 10:.2f} "
                    f"tokens/s, Accepted: {accepted:.0f} tokens, Drafted: {drafted:.0f} tokens, Per-position "
                    f"acceptance rate: {rates}, Avg Draft acceptance rate: {accepted / drafted * 100:.1f}%")
    assert totals.accepted_per_pos[0] >= totals.accepted_per_pos[1] > 0
    # One request alone: each target forward verifies its drafts, so it emits more than one token.
    steps = spec.num_steps
    one = spec.generate(prompts[:1], GREEDY_32)
    assert_greedy_equal_up_to_ties(reference, prompts[:1], one, continuations[:1])
    assert spec.num_steps - steps < len(continuations[0])


def test_mtp_sampling_keeps_the_target_distribution(trained):
    path, prompts, _ = trained
    kw = dict(num_kv_blocks=1024, block_size=8, max_num_seqs=64, max_num_batched_tokens=1024)
    plain = Engine(EngineConfig(**kw), loaded=load_model(str(path)))
    spec = Engine(EngineConfig(**kw, speculative_config=mtp_config(2)), loaded=load_model(str(path)))
    results = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        outs = []
        for start in range(0, 512, 64):
            params = [SamplingParams(max_tokens=3, temperature=0.8, top_k=12, seed=s, ignore_eos=True)
                      for s in range(start, start + 64)]
            outs += eng.generate([prompts[0]] * 64, params)
        results[name] = np.array(outs)
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted  # the trained layer's drafts are often, not always, accepted
    for pos in range(3):
        stat, dof = chi2_two_sample(results["plain"][:, pos], results["spec"][:, pos])
        assert stat < CHI2_999.get(dof, dof + 4 * np.sqrt(2 * dof)), (pos, stat, dof)


# -- Hugging Face's layout ----------------------------------------------------------------------------------

def hf_layout(weights: dict, fused_experts: bool) -> dict:
    """The tiny checkpoint as Hugging Face stores Qwen3-Next / Qwen3.5: zero-centred norms, convolutions
    [C, 1, K], experts one tensor each (Qwen3-Next) or gate/up fused per layer (Qwen3.5-MoE)."""
    out = {}
    for k, w in weights.items():
        if "conv1d.weight" in k:
            w = w.moveaxis(2, 1)
        elif k.endswith("norm.weight") and w.ndim == 1 and "linear_attn.norm" not in k:
            w = w - 1.0
        stem, sep, proj = k.partition(".switch_mlp.")
        if not sep:
            out[k] = w
        elif fused_experts:
            if proj == "down_proj.weight":
                out[f"{stem}.experts.down_proj"] = w
            elif proj == "gate_proj.weight":
                out[f"{stem}.experts.gate_up_proj"] = mx.concatenate(
                    [w, weights[f"{stem}.switch_mlp.up_proj.weight"]], axis=-2)
        else:
            for e in range(w.shape[0]):
                out[f"{stem}.experts.{e}.{proj}"] = w[e]
    return out


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_an_mtp_layer_in_hugging_face_layout_loads_as_in_mlx_layout(arch, tmp_path):
    d = make_tiny_model(tmp_path / "mlx", arch, seed=5, mtp=True)
    hf = tmp_path / "hf"
    shutil.copytree(d, hf)
    weights = hf_layout(dict(mx.load(str(d / "model.safetensors"))), fused_experts=arch == "qwen3_5_moe")
    assert any(k.startswith("mtp.") and ".experts." in k for k in weights)
    mx.save_safetensors(str(hf / "model.safetensors"), weights)
    layers = []
    for path in (d, hf):
        loaded = load_model(str(path))
        assert loaded.mtp.shifted_norms == (path == hf)
        layers.append(dict(tree_flatten(build_layer(loaded.model, loaded.model_type, loaded.mtp)[0].parameters())))
    assert layers[0].keys() == layers[1].keys()
    for name, w in layers[0].items():
        assert mx.allclose(w, layers[1][name], atol=1e-6).item(), name


def test_constrained_outputs_with_mtp_equal_outputs_without(trained):
    """MTP drafts of grammar-constrained requests go through the grammar walk before verification."""
    path, prompts, continuations = trained
    plain = Engine(EngineConfig(**KW), loaded=load_model(str(path)))
    spec = Engine(EngineConfig(**KW, speculative_config=mtp_config(2)), loaded=load_model(str(path)))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    # Two constrained requests beside two free ones: the free ones keep their trained acceptance,
    # the constrained ones' drafts (the model's unconstrained continuation) mostly fail the grammar.
    specs = [StructuredSpec("regex", "[0-9]{3}-[a-z]{4}"), StructuredSpec("choice", json.dumps(["yes", "no"])),
             None, None]
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=s is None, structured=s) for s in specs]
    batch = prompts[:4]
    expected = plain.generate(batch, params)
    assert expected[2:] == continuations[2:4]
    assert re.fullmatch("[0-9]{3}-[a-z]{4}", tokenizer.decode(expected[0], skip_special_tokens=True))
    assert tokenizer.decode(expected[1], skip_special_tokens=True) in ("yes", "no")
    assert spec.generate(batch, params) == expected
    drafted, accepted = spec_counts(spec)
    assert 0 < accepted < drafted
    # The constrained requests alone still speculate, and still match.
    assert spec.generate(batch[:2], params[:2]) == expected[:2]
    assert spec_counts(spec)[0] > drafted
    spec.scheduler.kv.pool.check_whole()
    for eng in (plain, spec):
        eng.grammars.shutdown()


def test_an_mtp_round_waits_for_the_device_once_whatever_k_unless_a_grammar_walks_it(trained):
    """Each position's drafts feed the next MTP forward on the device: 4 positions wait as often as
    1 (once for everything, once to read the drafts). A constrained request's grammar walk needs
    each token on the host, so a round with one waits at every position."""
    path, prompts, continuations = trained
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)]
    constrained = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredSpec("regex", "[0-9]{12}"))
    waits = {}
    for k in (1, 4):
        spec = Engine(EngineConfig(**KW, speculative_config=mtp_config(k)), loaded=load_model(str(path)))
        waits[k] = set(waits_per_draft_round(spec, prompts[:2], params))
        if k == 4:
            waits["grammar"] = waits_per_draft_round(spec, prompts[:2], [params[0], constrained])
            spec.grammars.shutdown()
    assert waits[4] == waits[1] == {2}, waits
    assert max(waits["grammar"]) > 2 * 4, waits
