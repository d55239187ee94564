"""Asynchronous scheduling gives the synchronous engine's outputs, token for token.

One seeded mixed workload runs on two engines over the same tiny model, one
reading each step's tokens at once and one scheduling the next step while its
tokens are still on the device: prompts long enough to be prefilled in
chunks, a queue longer than the running batch, a pool tight enough to
preempt, requests that stop on a token, on max_tokens and on the context,
aborts, seeded sampling, logprobs and penalties (whose steps are read before
the next is scheduled). Again with each step's graph encoded on a thread of
its own (``engined/fastpath/encode_thread.py``) while the engine builds the next; the
pool here also grows under the steps in flight.
"""

import random

import numpy as np
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import fresh_seed, make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=11, max_position_embeddings=4096)


def workload(seed: int):
    rng = random.Random(seed)
    jobs = []
    for i in range(14):
        kind = i % 7
        # 150 and 300 take several chunks of the 64-token budget. The two requests that run into the context
        # limit start long, so that both hold most of the pool at once, whatever the seed: the pool preempts.
        n = 300 if kind == 6 else rng.choice([5, 40, 150, 300])
        prompt = [rng.randrange(1, 250) for _ in range(n)]
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randrange(3, 20), temperature=0.0, ignore_eos=True)
        elif kind == 1:  # stops on a token it will likely meet soon: the greedy run's own fourth token
            params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[])
        elif kind == 2:  # top_p: without a host read, the rows whose kept set overflows are chosen on the device
            params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9 if i < 7 else 1.0,
                                    seed=rng.randrange(1 << 30), ignore_eos=True)
        elif kind == 3:
            params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
        elif kind == 4:
            params = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
        elif kind == 5:  # aborted once it has streamed a few tokens
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        else:  # runs into the context limit
            params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        jobs.append((f"r{i}", prompt, params, kind))
    return jobs


def run(tiny_dir, jobs, async_scheduling: bool, stop_tokens: dict, backend: str, encode_thread: bool = False,
        compile_decode: bool = False):
    engine = Engine(EngineConfig(num_kv_blocks=40, block_size=16, max_num_batched_tokens=64, max_num_seqs=6,
                                 max_model_len=360, async_scheduling=async_scheduling, encode_thread=encode_thread,
                                 attention_backend=backend, enable_prefix_caching=True,
                                 compile_decode=compile_decode),
                    loaded=load_model(str(tiny_dir)))
    assert engine.async_scheduling is async_scheduling
    assert (engine.encoder is not None) is (async_scheduling and encode_thread)
    for rid, prompt, params, kind in jobs:
        if kind == 1 and rid in stop_tokens:
            params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_tokens[rid]])
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid, *_ in jobs}
    reasons, logprobs = {}, {rid: [] for rid, *_ in jobs}
    aborted, overlapped = set(), 0
    while engine.has_unfinished():
        outs = engine.step()
        overlapped += bool(outs) and engine._inflight is not None
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or ()]
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        for rid, _, _, kind in jobs:
            if kind == 5 and rid not in aborted and len(tokens[rid]) >= 4:
                engine.abort([rid])
                aborted.add(rid)
    engine.scheduler.kv.pool.check_whole()
    if compile_decode:  # the decode steps, placeholders among their tokens, were replayed
        assert engine.runner.compiled.calls > engine.runner.compiled.traces > 0
    return tokens, reasons, logprobs, engine.scheduler.num_preemptions, overlapped


@pytest.mark.parametrize("backend,encode_thread,compiled", [("host", False, False), ("reference", False, False),
                                                            ("reference", True, False), ("reference", True, True)],
                         ids=["host", "reference", "reference-encode-thread", "reference-encode-thread-compiled"])
def test_async_and_sync_scheduling_give_identical_outputs(tiny_dir, backend, encode_thread, compiled):
    seed = fresh_seed()
    jobs = workload(seed)
    # The stop token of each kind-1 request: its fourth greedy token, so it stops early in both runs.
    first, *_ = run(tiny_dir, jobs, False, {}, backend)
    stops = {rid: first[rid][3] for rid, _, _, kind in jobs if kind == 1 and len(first[rid]) > 3}
    sync = run(tiny_dir, jobs, False, stops, backend)
    asyn = run(tiny_dir, jobs, True, stops, backend, encode_thread, compiled)
    assert asyn[0] == sync[0]
    assert asyn[1] == sync[1]
    # A step in flight also computes rows of requests that turn out to have stopped: batches differ by
    # those rows, and a matmul's rounding with the batch's shape (tokens above are equal all the same).
    assert asyn[2] == {rid: pytest.approx(lps, abs=2e-3) for rid, lps in sync[2].items()}
    assert set(sync[1].values()) >= {"stop", "length", "abort"}
    assert sync[3] > 0 and asyn[3] > 0, "the pool was meant to be tight enough to preempt"
    assert asyn[4] > 0 and sync[4] == 0, "the async engine returned outputs with a step in flight"


def test_pooled_results_with_the_encode_thread_equal_the_synchronous_engines(tiny_dir):
    """Embeddings of prompts prefilled in chunks, read while the encode thread holds the next step: each
    result is evaluated with its own step, so reading it waits only, and equals the synchronous engine's."""
    rng = random.Random(fresh_seed("pooled async"))
    prompts = [[rng.randrange(1, 250) for _ in range(rng.choice([20, 70, 150]))] for _ in range(6)]

    def embed(async_scheduling: bool) -> tuple[list, int]:
        engine = Engine(EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64, max_num_seqs=4,
                                     max_model_len=360, task="embed", async_scheduling=async_scheduling,
                                     encode_thread=async_scheduling, attention_backend="reference"),
                        loaded=load_model(str(tiny_dir)))
        assert (engine.encoder is not None) is async_scheduling
        for i, prompt in enumerate(prompts):
            engine.add_request(f"e{i}", prompt, SamplingParams(max_tokens=1), task="embed")
        got, overlapped = {}, 0
        while engine.has_unfinished():
            outs = [o for o in engine.step() if o.embedding]
            overlapped += bool(outs) and engine._inflight is not None
            got.update({o.request_id: np.frombuffer(o.embedding, "<f4") for o in outs})
        return [got[f"e{i}"] for i in range(len(prompts))], overlapped

    sync, _ = embed(False)
    asyn, overlapped = embed(True)
    assert overlapped > 0, "no result was read with a step in flight"
    for got, want in zip(asyn, sync):
        np.testing.assert_allclose(got, want, atol=1e-5)
