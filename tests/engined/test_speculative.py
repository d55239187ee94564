"""Speculative decoding: greedy outputs unchanged, sampling distribution preserved, opt-out honoured."""

import mlx.core as mx
import numpy as np
import pytest
from transformers import AutoTokenizer

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.engined.request import Request
from mlxd.engined.sampler import Sampler
from mlxd.engined.speculation.speculator import Verifier, ngram_propose
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.engined.device_waits import DeviceWaits
from tests.tiny_models import make_tiny_model, seeded_rng

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'

# Chi-square critical values at p = 0.001 by degrees of freedom: a correct
# sampler fails one of these checks about once in a thousand runs.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
            10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def test_ngram_proposes_what_followed_the_latest_match():
    t = np.array([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6])
    assert ngram_propose(t, 3, 1, 3) == [9, 2, 5]  # "5 6" last seen before at 5..6, followed by 9 2 5
    assert ngram_propose(np.array([1, 2, 3]), 3, 1, 3) == []
    assert ngram_propose(np.array([4, 4, 4, 4]), 2, 2, 2) == [4]  # only one token follows the match


def counts(samples, categories):
    return np.array([np.sum(samples == c) for c in categories])


def chi2_two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Two-sample chi-square over categories seen at least 10 times in all (rarer ones pooled)."""
    values, total = np.unique(np.concatenate([a, b]), return_counts=True)
    common = values[total >= 10]
    ca, cb = counts(a, common), counts(b, common)
    ca = np.append(ca, len(a) - ca.sum())
    cb = np.append(cb, len(b) - cb.sum())
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    n_a, n_b = ca.sum(), cb.sum()
    exp_a = (ca + cb) * n_a / (n_a + n_b)
    exp_b = (ca + cb) * n_b / (n_a + n_b)
    stat = float(((ca - exp_a) ** 2 / exp_a).sum() + ((cb - exp_b) ** 2 / exp_b).sum())
    return stat, len(ca) - 1


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_emits_the_target_distribution(with_draft_probs):
    vocab, n = 6, 3000
    target_logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3]] * 2)  # draft row + bonus row
    p = np.asarray(mx.softmax(target_logits[0]))
    sampler = Sampler(vocab, eos_token_ids=[])
    verifier = Verifier(sampler)
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0), seed=i) for i in range(n)]
    logits = mx.concatenate([target_logits] * n)
    if with_draft_probs:
        # A draft model's distribution, skewed towards a token the target finds unlikely;
        # its drafts are drawn from it, as a draft model's would be.
        q_row = np.array([0.05, 0.05, 0.1, 0.6, 0.1, 0.1])
        drafts = seeded_rng().choice(vocab, size=n, p=q_row)
        q = mx.concatenate([mx.array(np.stack([q_row, np.zeros(vocab)]), dtype=mx.float32)] * n)
    else:
        drafts = np.full(n, 3)  # an n-gram draft: deterministic, one-hot q
        q = None
    accept, alt = verifier(logits, reqs, [[int(t)] for t in drafts], q)
    accept, alt = np.asarray(accept).reshape(n, 2), np.asarray(alt).reshape(n, 2)
    first = np.where(accept[:, 0], drafts, alt[:, 0])
    observed = counts(first, range(vocab))
    expected = p * n
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert stat < CHI2_999[vocab - 1], (observed, expected.round())
    assert 0 < accept[:, 0].sum() < n


@pytest.fixture(scope="module")
def smol():
    base = dict(num_kv_blocks=800, max_num_batched_tokens=256, max_num_seqs=16)
    plain = Engine(EngineConfig(**base), loaded=load_model(""))
    spec = Engine(EngineConfig(**base, speculative_config=NGRAM), loaded=load_model(""))
    return plain, spec


def test_greedy_outputs_with_ngram_speculation_equal_outputs_without(smol):
    plain, spec = smol
    tok = AutoTokenizer.from_pretrained(plain.info.tokenizer_dir)
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    texts = [f"Rewrite this code with type hints:\n{code}", "Repeat after me: one two three one two three",
             f"Rename add to plus:\n{code}", "What is 2+2?", f"Copy exactly:\n{code}{code}"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    prompts = [list(p if isinstance(p, list) else p["input_ids"]) for p in prompts]
    for batch in ([0], [0, 1, 2, 3, 4], [4, 2]):
        ps = [prompts[i] for i in batch]
        params = SamplingParams(max_tokens=40, temperature=0.0)
        assert spec.generate(ps, params) == plain.generate(ps, params)
    accepted = spec.metrics.spec_accepted._value.get()
    drafted = spec.metrics.spec_draft_tokens._value.get()
    assert drafted > 0 and accepted > 0
    spec.scheduler.kv.pool.check_whole()


def test_opted_out_requests_decode_plainly_in_a_mixed_batch(smol):
    plain, spec = smol
    prompt = list(range(300, 340)) * 3  # repetitive: drafts are plentiful
    on = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    off = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculate=False)
    before = spec.metrics.spec_drafts._value.get()
    outs = spec.generate([prompt, prompt[:-1]], [off, off])
    assert spec.metrics.spec_drafts._value.get() == before  # nobody speculated
    mixed = spec.generate([prompt, prompt[:-1]], [on, off])
    assert spec.metrics.spec_drafts._value.get() > before
    assert mixed == outs == plain.generate([prompt, prompt[:-1]], on)


def test_sampled_token_frequencies_agree_with_and_without_speculation(tmp_path):
    d = make_tiny_model(tmp_path / "m", "llama", seed=11)
    plain = Engine(EngineConfig(num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048),
                   loaded=load_model(str(d)))
    spec = Engine(EngineConfig(num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048,
                               speculative_config=NGRAM), loaded=load_model(str(d)))
    # The model's own greedy continuation, then the seed again: drafts copy that
    # continuation, whose tokens the model finds likely, so many are accepted.
    seed = [40, 41, 42, 43] * 6
    prompt = seed + plain.generate([seed], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0] + seed
    n, steps = 768, 4
    results = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        outs = []
        for start in range(0, n, 64):
            params = [SamplingParams(max_tokens=steps, temperature=0.8, top_k=12, seed=s, ignore_eos=True)
                      for s in range(start, start + 64)]
            outs += eng.generate([prompt] * 64, params)
        results[name] = np.array(outs)
    assert spec.metrics.spec_accepted._value.get() > 0
    for pos in range(steps):
        stat, dof = chi2_two_sample(results["plain"][:, pos], results["spec"][:, pos])
        assert stat < CHI2_999.get(dof, dof + 4 * np.sqrt(2 * dof)), (pos, stat, dof)


def draft_engines(plain: Engine, tmp_path, num_kv_blocks: int):
    """(engine, good): engines speculating with a good draft (a second copy of the model) and a
    useless one (random weights, same vocabulary): outputs must not depend on the draft's quality."""
    from mlxd.engined.loaders import default_model_path

    random_draft = make_tiny_model(tmp_path / "draft", "llama", seed=2, vocab_size=plain.info.vocab_size)
    for draft, good in ((default_model_path(), True), (str(random_draft), False)):
        cfg = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 3}}'
        yield Engine(EngineConfig(num_kv_blocks=num_kv_blocks, max_num_batched_tokens=256, speculative_config=cfg),
                     loaded=load_model("")), good


def spec_counters(engine: Engine) -> tuple[float, float]:
    """(draft tokens, accepted tokens) counted by the engine's metrics so far."""
    return engine.metrics.spec_draft_tokens._value.get(), engine.metrics.spec_accepted._value.get()


def assert_drafts_were_verified(engine: Engine, good: bool) -> None:
    """Drafts ran; a good draft was nearly always accepted, a useless one was rejected at times."""
    drafted, accepted = spec_counters(engine)
    assert drafted > 0
    if good:
        assert accepted / drafted > 0.9
    else:
        assert accepted < drafted


def test_greedy_outputs_with_a_draft_model_equal_outputs_without(smol, tmp_path):
    plain, _ = smol
    prompt = list(range(300, 340)) * 2
    texts = [prompt, prompt[:50], list(range(1000, 1100))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = plain.generate(texts, params)
    for eng, good in draft_engines(plain, tmp_path, num_kv_blocks=200):
        assert eng.generate(texts, params) == expected
        assert eng.generate([texts[0]], params) == expected[:1]  # alone, too
        assert_drafts_were_verified(eng, good)
        # Both models' KV share one block allocation: the pool is billed for both.
        assert eng.memory.kv_bytes == eng.scheduler.kv.nbytes + eng.drafter.nbytes
        eng.scheduler.kv.pool.check_whole()


def test_draft_model_sampling_keeps_the_target_distribution(tmp_path):
    d = make_tiny_model(tmp_path / "m", "llama", seed=11)
    draft = make_tiny_model(tmp_path / "d", "llama", seed=12)  # a different model: real rejections
    cfg = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 2}}'
    kw = dict(num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048)
    plain = Engine(EngineConfig(**kw), loaded=load_model(str(d)))
    spec = Engine(EngineConfig(**kw, speculative_config=cfg), loaded=load_model(str(d)))
    prompt = [40, 41, 42, 43] * 4
    results = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        outs = []
        for start in range(0, 640, 64):
            params = [SamplingParams(max_tokens=3, temperature=0.8, top_k=12, seed=s, ignore_eos=True)
                      for s in range(start, start + 64)]
            outs += eng.generate([prompt] * 64, params)
        results[name] = np.array(outs)
    accepted = spec.metrics.spec_accepted._value.get()
    assert 0 < accepted < spec.metrics.spec_draft_tokens._value.get()
    for pos in range(3):
        stat, dof = chi2_two_sample(results["plain"][:, pos], results["spec"][:, pos])
        assert stat < CHI2_999.get(dof, dof + 4 * np.sqrt(2 * dof)), (pos, stat, dof)


def test_draft_model_with_another_vocabulary_is_refused(tmp_path):
    from mlxd.shared.errors import ModelLoadError

    draft = make_tiny_model(tmp_path / "d", "llama", seed=1)  # 272 tokens vs SmolLM2's 49152
    cfg = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 2}}'
    with pytest.raises(ModelLoadError, match="same tokenizer|share a tokenizer"):
        Engine(EngineConfig(num_kv_blocks=64, speculative_config=cfg))


# -- how often a draft round waits for the device -------------------------------------------------------

def waits_per_draft_round(engine: Engine, prompts, params) -> list[int]:
    """Generate with ``engine``; for each step whose drafter filled drafts, the waits for the device
    of its ``Speculator.draft`` (the whole proposal: forwards, sampling, the host's read of the drafts)."""
    speculator = engine.speculator
    draft, rounds = speculator.draft, []

    def counted(batch):
        with DeviceWaits() as waits:
            draft(batch)
        if batch.drafts:
            rounds.append(waits.count)

    speculator.draft = counted
    try:
        engine.generate(prompts, params)
    finally:
        del speculator.draft
    assert rounds
    return rounds


def test_a_draft_model_round_waits_for_the_device_once_whatever_k(tmp_path):
    """Drafts stay on the device from one position to the next: a round of 4 positions waits as
    often as a round of 1 (once for everything, once to read the drafts)."""
    d = make_tiny_model(tmp_path / "m", "llama", seed=11)
    draft = make_tiny_model(tmp_path / "d", "llama", seed=12)
    prompts = [[40, 41, 42, 43] * 3, list(range(30, 50))]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)]
    waits = {}
    for k in (1, 4):
        cfg = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": {k}}}'
        eng = Engine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=256, speculative_config=cfg),
                     loaded=load_model(str(d)))
        waits[k] = set(waits_per_draft_round(eng, prompts, params))
    assert waits[4] == waits[1] == {2}, waits
