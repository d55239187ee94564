"""Gemma 4's MTP assistant as a speculative proposer: transformers' semantics, outputs unchanged.

Tiny random-weight Gemma 4 targets (the 26B/31B text layout and the E2B/E4B
wrapper, ``tests/tiny_models.py``) with tiny random assistants
(``make_tiny_gemma4_assistant``, plain and centroid-masked heads). The
assistant's logits must be transformers' ``Gemma4AssistantForCausalLM``'s on
the same weights, the same target hidden state and the same shared K/V (read
from mlxd's paged pool); outputs must not depend on the assistant (greedy:
identical; sampled: the same distribution); an assistant trained on the
model's own continuations must be accepted often enough that the target runs
fewer forwards than it emits tokens.
"""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.engined.model_layers import text_model
from mlxd.engined.speculation.gemma4_assistant import LAYER_TYPES, Gemma4AssistantProposer, load_assistant
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ModelLoadError
from mlxd.shared.protocol import SamplingParams, StructuredSpec
from tests.engined.test_mtp import mixed_batch
from tests.engined.test_speculative import CHI2_999, chi2_two_sample, waits_per_draft_round
from tests.tiny_models import (assert_greedy_equal_up_to_ties, make_tiny_gemma4_assistant, make_tiny_model,
                               seeded_rng)

KW = dict(num_kv_blocks=256, block_size=8, max_num_seqs=8, max_num_batched_tokens=64)


def assistant_config(path, k: int, method: str | None = None) -> str:
    return json.dumps({"model": str(path), "num_speculative_tokens": k, **({"method": method} if method else {})})


def spec_counts(engine: Engine) -> tuple[float, float]:
    return engine.metrics.spec_draft_tokens._value.get(), engine.metrics.spec_accepted._value.get()


@pytest.fixture(scope="module", params=[("gemma4_text", False), ("gemma4", True)], ids=["text-plain", "e2b-masked"])
def pair(request, tmp_path_factory):
    """(target dir, assistant dir): the text layout with a plain head, the wrapper with the masked one."""
    arch, ordered = request.param
    seed = np.random.randint(1 << 30)
    print(f"{arch}: model seed {seed}")
    tmp = tmp_path_factory.mktemp(arch)
    target = make_tiny_model(tmp / "target", arch, seed=seed)
    return target, make_tiny_gemma4_assistant(tmp / "assistant", target, seed=seed + 1, ordered=ordered)


# -- transformers' semantics ---------------------------------------------------------------------------------

def hf_assistant(path):
    import torch
    from safetensors.torch import load_file
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    config = Gemma4AssistantConfig(**json.loads((path / "config.json").read_text()))
    config.text_config._attn_implementation = config._attn_implementation = "eager"
    model = Gemma4AssistantForCausalLM(config).eval()
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied: stored once
    model.load_state_dict(weights, strict=True)
    return model.to(torch.float32)


def pool_kv(read, row: int, first: int, last: int):
    """Keys and values of positions ``first..last`` of request ``row`` from a ``SharedRead``'s paged
    pools, as transformers' shared K/V ``[1, H_kv, L, D]``."""
    import torch

    table = np.asarray(read.meta.block_tables)[row]
    bs = read.meta.block_size
    pos = np.arange(first, last + 1)
    blocks, slots = mx.array(table[pos // bs]), mx.array(pos % bs)
    return tuple(torch.from_numpy(np.asarray(a[blocks, slots].astype(mx.float32))).permute(1, 0, 2)[None]
                 for a in (read.k, read.v))


def test_draft_logits_equal_transformers_assistant_on_the_same_shared_kv(pair):
    import torch

    target, assistant = pair
    k = 3
    eng = Engine(EngineConfig(**KW, speculative_config=assistant_config(assistant, k)), loaded=load_model(str(target)))
    proposer = eng.mtp
    assert isinstance(proposer, Gemma4AssistantProposer)
    calls = []
    step = proposer.step

    def recording(tokens, hidden, reads):
        out = step(tokens, hidden, reads)
        mx.eval(out)
        calls.append((tokens, hidden, reads, out))
        return out

    proposer.step = recording
    rng = seeded_rng()
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (7, 30)]  # inside and past the window of 12
    eng.generate(prompts, SamplingParams(max_tokens=k + 2, temperature=0.0, ignore_eos=True))
    # The first drafts of both requests, packed: k forwards of one row per request.
    calls = calls[:k]
    assert [len(tokens) for tokens, *_ in calls] == [2] * k
    hf = hf_assistant(assistant)
    window = json.loads((assistant / "config.json").read_text())["text_config"]["sliding_window"]
    body = proposer.embed, proposer.embed_scale
    for row, prompt in enumerate(prompts):
        p = len(prompt)  # the first sampled token's position: keys 0..p-1 are the target's
        tokens0, hidden0, reads, _ = calls[0]
        kv = {"full_attention": pool_kv(reads["full_attention"], row, 0, p - 1),
              "sliding_attention": pool_kv(reads["sliding_attention"], row, max(0, p - window + 1), p - 1)}
        hidden = torch.from_numpy(np.asarray(hidden0[row : row + 1]))[None]
        for j, (tokens, _, _, (logits, nxt)) in enumerate(calls):
            embedded = body[0](mx.array([tokens[row]])) * body[1]
            inputs = torch.cat([torch.from_numpy(np.asarray(embedded))[None], hidden], dim=-1)
            with torch.no_grad():
                out = hf(inputs_embeds=inputs, position_ids=torch.tensor([[p]]), shared_kv_states=kv)
            np.testing.assert_allclose(np.asarray(logits[row]), out.logits[0, 0].numpy(), rtol=1e-4, atol=1e-4,
                                       err_msg=f"request {row}, draft step {j}")
            np.testing.assert_allclose(np.asarray(nxt[row]), out.last_hidden_state[0, 0].numpy(), rtol=1e-4,
                                       atol=1e-4)
            if j + 1 < len(calls):  # greedy: the next step reads this step's argmax
                assert calls[j + 1][0][row] == int(np.argmax(np.asarray(logits[row])))
            hidden = out.last_hidden_state


def test_an_assistant_config_written_by_transformers_loads_as_the_generators(pair, tmp_path):
    """transformers 5 writes the full layers' head size as ``per_layer_config``, not ``global_head_dim``."""
    from transformers import Gemma4AssistantConfig

    target, assistant = pair
    written = tmp_path / "written"
    shutil.copytree(assistant, written)
    config = Gemma4AssistantConfig(**json.loads((assistant / "config.json").read_text())).to_dict()
    assert not config["text_config"].get("global_head_dim") and config["text_config"]["per_layer_config"]
    (written / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(target))
    models = [dict(tree_flatten(load_assistant(d, loaded.model, loaded.model_type).parameters()))
              for d in (assistant, written)]
    assert models[0].keys() == models[1].keys()
    assert all(mx.array_equal(w, models[1][name]).item() for name, w in models[0].items())


# -- outputs unchanged -----------------------------------------------------------------------------------------

def test_greedy_outputs_with_the_assistant_equal_plain_decoding_on_mixed_batches(pair):
    target, assistant = pair
    rng = seeded_rng()
    plain = Engine(EngineConfig(**KW), loaded=load_model(str(target)))
    spec = Engine(EngineConfig(**KW, speculative_config=assistant_config(assistant, 3, "mtp")),
                  loaded=load_model(str(target)))
    assert spec.config.enable_prefix_caching
    prompts, params = mixed_batch(rng)
    expected = plain.generate(prompts, params)
    assert spec.generate(prompts, params) == expected
    hits = spec.stats().prefix_cache_hits
    for i in (4, 5):  # resumes from the cached prefix: the assistant reads K/V it never wrote
        assert spec.generate([prompts[i]], params[i]) == [expected[i]]
    assert spec.stats().prefix_cache_hits >= hits + 16
    drafted, _ = spec_counts(spec)
    assert drafted > 0
    # It writes no K/V: the pool is billed as without it.
    assert spec.scheduler.kv.bytes_per_block == plain.scheduler.kv.bytes_per_block
    spec.step()
    assert not spec.mtp.pending  # finished requests are forgotten at the next step
    spec.scheduler.kv.pool.check_whole()


def test_greedy_constrained_outputs_with_the_assistant_equal_plain_decoding(pair):
    target, assistant = pair
    plain = Engine(EngineConfig(**KW), loaded=load_model(str(target)))
    spec = Engine(EngineConfig(**KW, speculative_config=assistant_config(assistant, 3)), loaded=load_model(str(target)))
    specs = [StructuredSpec("regex", "[a-z]{3,8}( [a-z]{2,6}){2,4}\\."), StructuredSpec("choice", '["yes", "no"]'), None]
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured=s) for s in specs]
    prompts = [seeded_rng().integers(0, 256, size=8).tolist()] * len(specs)
    expected = plain.generate(prompts, params)
    assert spec.generate(prompts, params) == expected
    assert spec_counts(spec)[0] > 0


def test_assistant_sampling_keeps_the_target_distribution(pair):
    target, assistant = pair
    # Flat distributions over the whole vocabulary: a random assistant's drafts are then kept 15 to
    # 35 % of the time (at temperature 1 anything from 0 to 10 %, by how peaked the tiny model is).
    drafted, accepted = assert_sampling_keeps_the_target_distribution(
        target, assistant, seeded_rng().integers(0, 256, size=9).tolist(), dict(temperature=2.0))
    assert 0 < accepted < drafted


def assert_sampling_keeps_the_target_distribution(target, assistant, prompt: list[int],
                                                  sampling: dict) -> tuple[float, float]:
    """Token frequencies at each position agree with and without the assistant; (drafted, accepted)."""
    kw = dict(num_kv_blocks=1024, block_size=8, max_num_seqs=64, max_num_batched_tokens=1024)
    plain = Engine(EngineConfig(**kw), loaded=load_model(str(target)))
    spec = Engine(EngineConfig(**kw, speculative_config=assistant_config(assistant, 2)), loaded=load_model(str(target)))
    results = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        outs = []
        for start in range(0, 512, 64):
            params = [SamplingParams(max_tokens=4, **sampling, seed=s, ignore_eos=True)
                      for s in range(start, start + 64)]
            outs += eng.generate([prompt] * 64, params)
        results[name] = np.array(outs)
    drafted, accepted = spec_counts(spec)
    print(f"accepted {accepted:.0f} of {drafted:.0f} drafts")
    for pos in range(4):
        stat, dof = chi2_two_sample(results["plain"][:, pos], results["spec"][:, pos])
        # dof 0: one token at that position in both runs, the same distribution.
        assert dof == 0 or stat < CHI2_999.get(dof, dof + 4 * np.sqrt(2 * dof)), (pos, stat, dof)
    return drafted, accepted


# -- refused at load ---------------------------------------------------------------------------------------------

def test_a_bad_assistant_is_refused_at_load(pair, tmp_path):
    target, assistant = pair
    wrong = make_tiny_gemma4_assistant(tmp_path / "wide", target, seed=1, backbone_hidden_size=48)
    with pytest.raises(ModelLoadError, match="backbone_hidden_size is 48; the target's hidden size is 64"):
        Engine(EngineConfig(**KW, speculative_config=assistant_config(wrong, 2)), loaded=load_model(str(target)))
    llama = make_tiny_model(tmp_path / "llama", "llama", seed=1)
    with pytest.raises(ModelLoadError, match="drafts for a Gemma 4 target.*this model is 'llama'"):
        Engine(EngineConfig(**KW, speculative_config=assistant_config(assistant, 2)), loaded=load_model(str(llama)))
    with pytest.raises(ModelLoadError, match="takes a Gemma 4 assistant checkpoint"):
        Engine(EngineConfig(**KW, speculative_config=assistant_config(llama, 2, "mtp")), loaded=load_model(str(target)))


# -- a trained assistant: real acceptance -------------------------------------------------------------------

ACCEPTANCE_FLOOR = 0.5  # a random assistant's greedy drafts are accepted about 1 time in 272 (the vocabulary)
GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


class KVRecorder(nn.Module):
    """A target layer that keeps the K/V it hands its KV-shared layers (mlx_lm's plain forward)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.layer_type = inner, inner.layer_type

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.kv = out[1]
        return out


def train_assistant(target_dir, assistant_dir, out_dir, prompts, continuations, steps: int) -> float:
    """Train the assistant's two draft steps on the target's greedy continuations: step 0 predicts
    ``x[p+1]`` from ``x[p]``, ``h[p-1]`` and the target's K/V before ``p``; step 1 ``x[p+2]`` from
    ``x[p+1]`` and step 0's projection, at the same position. Writes the trained checkpoint."""
    loaded = load_model(str(target_dir))
    text = text_model(loaded.model)
    args, body = text.args, text.model
    seqs = [p + c for p, c in zip(prompts, continuations)]
    length = min(len(s) for s in seqs)
    tokens = mx.array([s[:length] for s in seqs])
    own = args.num_hidden_layers - args.num_kv_shared_layers
    sources = {kind: max(i for i in range(own) if args.layer_types[i] == kind) for kind in LAYER_TYPES}
    for i in sources.values():
        body.layers[i] = KVRecorder(body.layers[i])
    hidden = mx.stop_gradient(body(tokens))  # the target's final normed hidden states [B, L, H]
    kv = {kind: tuple(mx.stop_gradient(a) for a in body.layers[i].kv) for kind, i in sources.items()}
    assistant = load_assistant(assistant_dir, loaded.model, loaded.model_type)
    # Query row i is position p = i + 1: keys before p; a sliding layer's, the last window - 1 of them.
    p = mx.arange(1, length)[:, None]
    key = mx.arange(length)[None, :]
    window = min(args.sliding_window, assistant.args.sliding_window)
    masks = {"full_attention": key < p, "sliding_attention": (key < p) & (key > p - window)}
    embed = body.embed_tokens(tokens) * body.embed_scale
    # Only the continuation's tokens are the model's to predict; the prompts are random.
    weight = mx.array([[float(t >= len(q)) for t in range(length)] for q in prompts])

    def run(model, x, rows):
        h = model.pre_projection(x)
        for layer in model.layers:
            h, _, _ = layer(h, masks[layer.layer_type][:rows], None, shared_kv=kv[layer.layer_type], offset=1)
        h = model.norm(h)
        return model.lm_head(h), model.post_projection(h)

    def loss_fn(model):
        logits0, proj0 = run(model, mx.concatenate([embed[:, 1:], hidden[:, :-1]], axis=-1), length - 1)
        logits1, _ = run(model, mx.concatenate([embed[:, 2:], proj0[:, :-1]], axis=-1), length - 2)
        ce0 = nn.losses.cross_entropy(logits0[:, :-1], tokens[:, 2:], reduction="none") * weight[:, 2:]
        ce1 = nn.losses.cross_entropy(logits1[:, :-1], tokens[:, 3:], reduction="none") * weight[:, 3:]
        return ce0.sum() / weight[:, 2:].sum() + ce1.sum() / weight[:, 3:].sum()

    opt = optim.Adam(learning_rate=1e-2)
    step = nn.value_and_grad(assistant, loss_fn)
    for _ in range(steps):
        loss, grads = step(assistant)
        opt.update(assistant, grads)
        mx.eval(assistant.parameters(), opt.state)
    save_assistant(assistant, json.loads((assistant_dir / "config.json").read_text()), out_dir)
    return loss.item()


def save_assistant(assistant, config: dict, out_dir) -> None:
    """Write ``assistant`` as a checkpoint under transformers' names (the head as the tied embedding,
    with its scales and biases where quantized)."""
    out_dir.mkdir()
    (out_dir / "config.json").write_text(json.dumps(config))
    weights = {(k.replace("lm_head.", "model.embed_tokens.", 1) if k.startswith("lm_head.") else
                k if k.startswith(("pre_projection", "post_projection")) else f"model.{k}"): v
               for k, v in tree_flatten(assistant.parameters())}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Gemma 4 (text layout) and an assistant trained on its greedy continuations of 8
    prompts: (target, assistant, prompts, continuations)."""
    tmp = tmp_path_factory.mktemp("trained")
    rng = seeded_rng()
    seed = int(rng.integers(1 << 30))
    target = make_tiny_model(tmp / "target", "gemma4_text", seed=seed)
    untrained = make_tiny_gemma4_assistant(tmp / "assistant", target, seed=seed + 1)
    prompts = [rng.integers(0, 256, size=6).tolist() for _ in range(8)]
    continuations = Engine(EngineConfig(**KW), loaded=load_model(str(target))).generate(prompts, GREEDY_32)
    loss = train_assistant(target, untrained, tmp / "trained", prompts, continuations, steps=80)
    print(f"assistant training loss {loss:.3f}")
    return target, tmp / "trained", prompts, continuations


def test_a_trained_assistant_is_accepted_and_saves_target_forwards(trained):
    target, assistant, prompts, continuations = trained
    spec = Engine(EngineConfig(**KW, speculative_config=assistant_config(assistant, 2)), loaded=load_model(str(target)))
    reference = load_model(str(target)).model  # mlx_lm's own forward, for the greedy choices
    assert_greedy_equal_up_to_ties(reference, prompts, spec.generate(prompts, GREEDY_32), continuations)
    drafted, accepted = spec_counts(spec)
    print(f"accepted {accepted:.0f} of {drafted:.0f} drafts")
    assert accepted / drafted > ACCEPTANCE_FLOOR
    totals = spec.metrics.spec
    assert totals.accepted_per_pos[0] >= totals.accepted_per_pos[1] > 0
    # One request alone: each target forward verifies its drafts, so it emits more than one token.
    steps = spec.num_steps
    one = spec.generate(prompts[:1], GREEDY_32)
    assert_greedy_equal_up_to_ties(reference, prompts[:1], one, continuations[:1])
    assert spec.num_steps - steps < len(continuations[0])


def test_trained_assistant_sampling_keeps_the_target_distribution(trained):
    target, assistant, prompts, _ = trained
    # Kept half the time or nearly always, by how peaked the tiny target is at this temperature.
    drafted, accepted = assert_sampling_keeps_the_target_distribution(target, assistant, prompts[0],
                                                                      dict(temperature=0.6))
    assert accepted > 0


def test_each_draft_round_reads_the_targets_hidden_state_before_the_last_token(trained):
    """After verification kept ``m`` of ``k`` drafts (here all, some or none: sampled), the next
    round's step 0 reads the target's hidden state of the last kept row, as a plain forward has it."""
    target, assistant, prompts, _ = trained
    spec = Engine(EngineConfig(**KW, speculative_config=assistant_config(assistant, 2)), loaded=load_model(str(target)))
    proposer, seen = spec.mtp, []
    last_hidden = proposer._last_hidden

    def recording(req):
        row = last_hidden(req)
        seen.append((req.token_ids[: req.num_computed_tokens], np.asarray(row[0])))
        return row

    proposer._last_hidden = recording
    params = [SamplingParams(max_tokens=16, temperature=0.6, seed=s, ignore_eos=True) for s in range(len(prompts))]
    spec.generate(prompts, params)
    assert len(seen) > 2 * len(prompts)
    body = text_model(load_model(str(target)).model).model
    # The engine's packed steps sum in other orders than one plain forward: float32 rows differ in the
    # last bits, which four layers grow to ~2e-4 on some seeds; another position's row differs by ~1.
    for tokens, row in seen:
        np.testing.assert_allclose(row, np.asarray(body(mx.array([tokens]))[0, -1]), rtol=1e-3, atol=1e-3)


def test_an_assistant_round_waits_for_the_device_once_whatever_k(trained):
    """Each step's drafts feed the next assistant forward on the device: 4 steps wait as often as 1
    (once for everything, once to read the drafts)."""
    target, assistant, prompts, _ = trained
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)]
    waits = {}
    for k in (1, 4):
        spec = Engine(EngineConfig(**KW, speculative_config=assistant_config(assistant, k)),
                      loaded=load_model(str(target)))
        waits[k] = set(waits_per_draft_round(spec, prompts[:2], params))
    assert waits[4] == waits[1] == {2}, waits

