"""One request cannot take the step down: a request whose sampling setup raises fails alone.

Its client hears of it through ``Engine.take_errors``; the requests batched
with it (greedy and seeded sampling, with and without n-gram speculation)
finish with exactly the tokens they give alone, every block comes back, and
the engine goes on serving.
"""

import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.engined.structured import Grammar
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import SamplingParams, StructuredSpec
from tests.tiny_models import fresh_seed, make_tiny_model, seeded_rng

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("isolation"), "llama", seed=fresh_seed("model"))


def add(engine, requests) -> None:
    """Queue ``{id: (prompt, params)}`` in order."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)


def drain(engine, ids):
    """Step to the end; returns (tokens by id, errors by id)."""
    tokens, errors = {rid: [] for rid in ids}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        errors.update(engine.take_errors())
    return tokens, errors


def run(engine, requests):
    add(engine, requests)
    return drain(engine, requests)


def healthy_requests(rng):
    motif = rng.integers(0, 256, size=5).tolist()
    prompts = [rng.integers(0, 256, size=int(n)).tolist() + motif * 3 for n in (7, 30, 12)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=int(rng.integers(1 << 30)),
                             ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    return {f"ok{i}": (p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram"])
def test_a_request_whose_sampling_setup_raises_fails_alone(tiny_dir, speculative):
    engine = Engine(EngineConfig(num_kv_blocks=128, block_size=8, max_num_seqs=8, speculative_config=speculative),
                    loaded=load_model(str(tiny_dir)))
    rng = seeded_rng()
    healthy = healthy_requests(rng)
    alone = {rid: run(engine, {rid: req})[0][rid] for rid, req in healthy.items()}

    # A top_k past int64 slipped by validation: MLX cannot take it (std::bad_cast), the
    # input of issue 18 that killed the engine. It sits in the middle of the batch.
    bad = SamplingParams(max_tokens=4, temperature=1.0, top_k=5, ignore_eos=True)
    ids = list(healthy)
    batch = {ids[0]: healthy[ids[0]], "bad": (healthy[ids[1]][0], bad), **{r: healthy[r] for r in ids[1:]}}
    add(engine, batch)
    engine.requests["bad"].params.top_k = 1 << 63
    tokens, errors = drain(engine, batch)

    assert set(errors) == {"bad"} and isinstance(errors["bad"], InvalidRequestError)
    assert "could not be sampled" in errors["bad"].message
    assert {rid: tokens[rid] for rid in ids} == alone
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
    # The engine still serves, the failed request's id is free again.
    assert run(engine, {"bad": healthy[ids[0]]})[0]["bad"] == alone[ids[0]]


def test_a_grammar_that_fails_fails_only_its_request(tiny_dir):
    engine = Engine(EngineConfig(num_kv_blocks=128, block_size=8), loaded=load_model(str(tiny_dir)))
    healthy = healthy_requests(seeded_rng())
    alone = {rid: run(engine, {rid: req})[0][rid] for rid, req in healthy.items()}
    # Well-formed JSON, but not a schema llguidance compiles: it fails on the compile thread.
    broken = StructuredSpec("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}')
    ids = list(healthy)
    batch = {ids[0]: healthy[ids[0]],
             "bad": ([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, structured=broken)),
             **{r: healthy[r] for r in ids[1:]}}
    tokens, errors = run(engine, batch)
    assert set(errors) == {"bad"} and isinstance(errors["bad"], InvalidRequestError)
    assert tokens["bad"] == [] and {rid: tokens[rid] for rid in ids} == alone


class BrokenGrammar(Grammar):
    """A real compiled grammar whose ``accept`` or ``check_draft`` raises: a fault injector.

    Nothing a client sends reaches these raises (the gateway and ``add_request``
    validate, the sampler masks); what is proven is that a raise there, whatever
    its cause, costs only its own request.
    """

    def __init__(self, real: Grammar, broken: str):
        super().__init__(real.kind, real.future)
        self.broken = broken

    def accept(self, token):
        if self.broken == "accept":
            raise RuntimeError("matcher state lost")
        return super().accept(token)

    def check_draft(self, draft, bits):
        if self.broken == "check_draft":
            raise RuntimeError("matcher state lost")
        return super().check_draft(draft, bits)


@pytest.mark.parametrize("speculative,broken,what", [
    (None, "accept", "its grammar could not take the sampled token"),
    (NGRAM, "accept", "its grammar could not take the sampled token"),
    (NGRAM, "check_draft", "its draft could not be proposed"),
], ids=["plain-accept", "ngram-accept", "ngram-propose"])
def test_a_request_whose_grammar_step_raises_fails_alone(tiny_dir, speculative, broken, what):
    engine = Engine(EngineConfig(num_kv_blocks=128, block_size=8, max_num_seqs=8, speculative_config=speculative),
                    loaded=load_model(str(tiny_dir)))
    healthy = healthy_requests(seeded_rng())
    alone = {rid: run(engine, {rid: req})[0][rid] for rid, req in healthy.items()}
    ids = list(healthy)
    # Its grammar makes it repeat itself, so the n-gram proposer soon drafts for it.
    prompt = healthy[ids[1]][0] * 2
    constrained = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredSpec("regex", "(ab){12,40}"))
    batch = {ids[0]: healthy[ids[0]], "bad": (prompt, constrained), **{r: healthy[r] for r in ids[1:]}}
    add(engine, batch)
    req = engine.requests["bad"]
    req.grammar = BrokenGrammar(req.grammar, broken)
    tokens, errors = drain(engine, batch)

    assert set(errors) == {"bad"} and isinstance(errors["bad"], InvalidRequestError)
    assert what in errors["bad"].message and "matcher state lost" in errors["bad"].message
    # (What it emitted before its grammar broke did reach its client.)
    assert {rid: tokens[rid] for rid in ids} == alone
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert run(engine, {"bad": healthy[ids[0]]})[0]["bad"] == alone[ids[0]]
