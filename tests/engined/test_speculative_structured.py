"""Speculative decoding of grammar-constrained requests: drafts checked by the grammar, outputs unchanged."""

import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from transformers import AutoTokenizer

from mlxd.engined.request import Request
from mlxd.engined.sampler import Sampler
from mlxd.engined.speculation.speculator import Verifier
from mlxd.shared.protocol import SamplingParams, StructuredSpec
from tests.engined.test_speculative import (  # noqa: F401 (smol: the engines fixture)
    CHI2_999, assert_drafts_were_verified, counts, draft_engines, smol, spec_counters,
)
from tests.engined.test_structured import PERSON, chat_ids, text_of
from tests.tiny_models import seeded_rng

DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def tokenizer(smol):
    return AutoTokenizer.from_pretrained(smol[0].info.tokenizer_dir)


def compiled(engine, kind, spec):
    g = engine.grammars.submit(StructuredSpec(kind, spec))
    g.future.result()
    assert g.ready and g.error is None
    return g


def char_ids(tokenizer, text):
    ids = [tokenizer.encode(c) for c in text]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def test_grammar_walk_cuts_the_draft_at_the_first_rejected_token_and_rolls_back(smol, tokenizer):
    plain, _ = smol
    g = compiled(plain, "regex", DATE)
    assert g.accept(char_ids(tokenizer, "2")[0]) is None  # the walk starts after an accepted token
    before = np.asarray(plain.grammars.token_bitmask([g]))
    draft = char_ids(tokenizer, "024-0x-01")  # "x" where the month's second digit must be
    bits = plain.grammars.new_bits(len(draft) + 1)
    n = g.check_draft(draft, bits)
    assert n == 5
    masks = np.asarray(plain.grammars.to_mask(bits))
    # Row i is the mask after the first i draft tokens, as a second matcher stepped by hand sees it.
    ref = compiled(plain, "regex", DATE)
    ref.accept(char_ids(tokenizer, "2")[0])
    for i in range(n + 1):
        assert (masks[i] == np.asarray(plain.grammars.token_bitmask([ref]))[0]).all(), i
        if i < n:
            assert masks[i, draft[i]]
            ref.accept(draft[i])
    assert not masks[n, draft[n]] and masks[n].sum() == 9  # "01".."09" for the month: digits 1-9
    # Rolled back: the matcher is where it was, and the accepted tokens are consumed only now.
    assert (np.asarray(plain.grammars.token_bitmask([g])) == before).all()
    for t in draft[:n]:
        assert g.accept(t) is None


def test_grammar_walk_stops_after_the_token_that_completes_the_grammar(smol, tokenizer):
    plain, _ = smol
    g = compiled(plain, "choice", json.dumps(CHOICES))
    yes, no = tokenizer.encode("yes")[0], tokenizer.encode("no")[0]
    bits = plain.grammars.new_bits(4)
    assert g.check_draft([yes, no, no], bits) == 1
    masks = np.asarray(plain.grammars.to_mask(bits))
    assert masks[0, yes] and masks[0, no]
    assert np.flatnonzero(masks[1]).tolist() == plain.info.eos_token_ids  # complete: only EOS may follow
    assert not g.matcher.is_stopped()
    assert g.accept(no) == "stop"


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_masked_rejection_sampling_emits_the_masked_target_distribution(with_draft_probs):
    vocab, n = 6, 3000
    target_logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3]] * 2)  # draft row + bonus row
    allowed_row = np.array([False, True, True, True, False, True])  # the grammar forbids the likeliest token
    p = np.where(allowed_row, np.exp(np.asarray(target_logits[0])), 0.0)
    p /= p.sum()
    verifier = Verifier(Sampler(vocab, eos_token_ids=[]))
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0), seed=i) for i in range(n)]
    if with_draft_probs:
        q_row = np.where(allowed_row, [0.05, 0.05, 0.1, 0.6, 0.1, 0.1], 0.0)
        q_row /= q_row.sum()
        drafts = seeded_rng().choice(vocab, size=n, p=q_row)
        q = mx.concatenate([mx.array(np.stack([q_row, np.zeros(vocab)]), dtype=mx.float32)] * n)
    else:
        drafts = np.full(n, 3)
        q = None
    allowed = mx.array(np.tile(allowed_row, (2 * n, 1)))
    accept, alt = verifier(mx.concatenate([target_logits] * n), reqs, [[int(t)] for t in drafts], q, allowed)
    accept, alt = np.asarray(accept).reshape(n, 2), np.asarray(alt).reshape(n, 2)
    first = np.where(accept[:, 0], drafts, alt[:, 0])
    assert allowed_row[first].all() and allowed_row[alt[:, 1]].all()  # the bonus token too
    keep = np.flatnonzero(allowed_row)
    observed, expected = counts(first, keep), p[keep] * n
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert stat < CHI2_999[len(keep) - 1], (observed, expected.round())


def mixed_batch(tokenizer):
    """Constrained requests whose prompts hold what they will write (n-gram drafts find it), and a plain one."""
    example = '{"name": "Ada", "age": 36, "role": "admin", "tags": ["math", "code"]}'
    prompts = [
        chat_ids(tokenizer, f"Return exactly this JSON: {example}"),
        chat_ids(tokenizer, "The date is 2024-05-17. Repeat the date: 2024-05-17"),
        chat_ids(tokenizer, "Answer maybe. Answer with one word: maybe"),
        chat_ids(tokenizer, "Repeat after me: one two three one two three"),
    ]
    specs = [StructuredSpec("json_schema", json.dumps(PERSON)), StructuredSpec("regex", DATE),
             StructuredSpec("choice", json.dumps(CHOICES)), None]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured=s) for s in specs]
    return prompts, params


def assert_valid(tokenizer, outs):
    person, date, choice, _ = (text_of(tokenizer, o) for o in outs)
    jsonschema.validate(json.loads(person), PERSON)
    assert re.fullmatch(DATE, date), date
    assert choice in CHOICES


def test_greedy_constrained_outputs_with_ngram_speculation_equal_outputs_without(smol, tokenizer):
    plain, spec = smol
    prompts, params = mixed_batch(tokenizer)
    expected = plain.generate(prompts, params)
    assert_valid(tokenizer, expected)
    drafted, accepted = spec_counters(spec)
    # Constrained requests alone: the counters move only if they speculate.
    assert spec.generate(prompts[:3], params[:3]) == expected[:3]
    drafted2, accepted2 = spec_counters(spec)
    assert drafted2 > drafted and accepted2 > accepted
    assert spec.generate(prompts, params) == expected
    assert spec.generate(prompts[::-1], params[::-1]) == expected[::-1]
    spec.scheduler.kv.pool.check_whole()


def test_greedy_constrained_outputs_with_a_draft_model_equal_outputs_without(smol, tokenizer, tmp_path):
    plain, _ = smol
    prompts, params = mixed_batch(tokenizer)
    expected = plain.generate(prompts, params)
    # A good draft (the model itself) and a useless one (random weights, same
    # vocabulary) whose grammar-masked drafts the target mostly rejects.
    for eng, good in draft_engines(plain, tmp_path, num_kv_blocks=300):
        assert eng.generate(prompts[:3], params[:3]) == expected[:3]
        assert_drafts_were_verified(eng, good)
        assert eng.generate(prompts, params) == expected
        eng.scheduler.kv.pool.check_whole()
        eng.grammars.shutdown()
