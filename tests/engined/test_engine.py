"""The in-process Engine on the real SmolLM2 GGUF: answers, batching equivalence, sampling controls."""

import mlx.core as mx
import numpy as np
import pytest
from transformers import AutoTokenizer

from mlxd.engined.engine import Engine
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ContextLengthError, InvalidRequestError
from mlxd.shared.protocol import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(num_kv_blocks=600, max_num_batched_tokens=256, max_num_seqs=16))


@pytest.fixture(scope="module")
def tokenizer(engine):
    return AutoTokenizer.from_pretrained(engine.info.tokenizer_dir)


def chat_ids(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_smollm2_answers_paris(engine, tokenizer):
    out = engine.generate([chat_ids(tokenizer, "What is the capital of France?")], greedy(24))[0]
    assert "Paris" in tokenizer.decode(out)
    engine.scheduler.kv.pool.check_whole()


def test_sixteen_concurrent_greedy_requests_equal_sequential_runs(engine, tokenizer):
    topics = ["the sea", "a cat", "Rome", "winter", "bread", "music", "a robot", "the moon",
              "rain", "chess", "a train", "coffee", "gardens", "a river", "snow", "stars"]
    # Different lengths: some prompts repeated to make them long enough to chunk.
    prompts = [chat_ids(tokenizer, f"Write about {t}. " * (1 + i % 5)) for i, t in enumerate(topics)]
    params = [greedy(8 + i % 9, ignore_eos=True) for i in range(16)]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert together == alone
    assert [len(o) for o in together] == [p.max_tokens for p in params]
    engine.scheduler.kv.pool.check_whole()


def test_seeded_sampling_reproduces_whatever_the_batch(engine, tokenizer):
    prompt = chat_ids(tokenizer, "Tell me a story.")
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0]
    others = [SamplingParams(max_tokens=5, temperature=0.8, ignore_eos=True)] * 3
    crowd = engine.generate([chat_ids(tokenizer, "Hi"), prompt, chat_ids(tokenizer, "Yo"), prompt],
                            [others[0], seeded, others[1], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)])
    assert crowd[1] == alone
    assert crowd[3] != alone


def test_top_k_one_equals_greedy_and_logit_bias_forces_a_token(engine, tokenizer):
    prompt = chat_ids(tokenizer, "Name a colour.")
    assert engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1.5, top_k=1, ignore_eos=True))[0] == \
        engine.generate([prompt], greedy(6, ignore_eos=True))[0]
    forced = tokenizer.encode(" banana")[0]
    out = engine.generate([prompt], greedy(4, logit_bias={forced: 100.0}, ignore_eos=True))[0]
    assert out == [forced] * 4


def test_stop_tokens_min_tokens_and_max_tokens(engine, tokenizer):
    prompt = chat_ids(tokenizer, "What is the capital of France?")
    free = engine.generate([prompt], greedy(40))[0]
    assert free[-1] in engine.info.eos_token_ids  # the stop token is reported as the last token
    stop_at = free[2]
    out = engine.generate([prompt], greedy(40, stop_token_ids=[stop_at]))[0]
    assert out == free[:3]
    longer = engine.generate([prompt], greedy(len(free) + 5, min_tokens=len(free) + 3))[0]
    assert len(longer) >= len(free) + 3 and engine.info.eos_token_ids[0] not in longer[: len(free) + 2]
    assert len(engine.generate([prompt], greedy(3))[0]) == 3


def test_penalties_change_repetitive_output(engine, tokenizer):
    prompt = chat_ids(tokenizer, "Repeat the word 'hello' twenty times.")
    plain = engine.generate([prompt], greedy(20, ignore_eos=True))[0]
    penalized = engine.generate([prompt], greedy(20, ignore_eos=True, frequency_penalty=2.0, repetition_penalty=1.5))[0]
    assert len(set(penalized)) > len(set(plain))


def test_logprobs_are_normalized_and_name_the_sampled_token(engine, tokenizer):
    prompt = chat_ids(tokenizer, "Say yes.")
    engine.add_request("lp", prompt, greedy(3, logprobs=5, ignore_eos=True))
    records, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            records += out.logprobs or []
    assert len(records) == 3
    for tok, rec in zip(tokens, records):
        assert rec.top_ids[0] == tok  # greedy: the sampled token is the most likely
        assert rec.logprob == pytest.approx(rec.top_logprobs[0], abs=1e-5)
        assert rec.top_logprobs == sorted(rec.top_logprobs, reverse=True)
        assert 0.0 < sum(np.exp(rec.top_logprobs)) <= 1.0 + 1e-5


def test_abort_frees_blocks_at_once_and_reports_it(engine, tokenizer):
    engine.add_request("gone", chat_ids(tokenizer, "Count to one hundred."), greedy(200, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
    engine.abort(["gone", "never-existed"])
    assert engine.stats().num_running == 0
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("gone", "abort")]
    engine.scheduler.kv.pool.check_whole()


def test_requests_that_can_never_fit_are_rejected_at_once(engine):
    with pytest.raises(ContextLengthError):
        engine.add_request("long", [1] * engine.info.max_model_len, greedy(1))
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError):
        engine.add_request("oov", [1, 10**9], greedy(1))
    assert not engine.has_unfinished()


def test_preemption_under_a_tight_pool_keeps_greedy_outputs(tokenizer):
    small = Engine(EngineConfig(num_kv_blocks=12, block_size=16, max_num_seqs=8, max_num_batched_tokens=128))
    prompts = [chat_ids(tokenizer, f"List {n} animals.") for n in range(4)]
    params = greedy(48, ignore_eos=True)
    together = small.generate(prompts, params)
    assert small.stats().num_preemptions > 0
    alone = [small.generate([p], params)[0] for p in prompts]
    assert together == alone
    small.scheduler.kv.pool.check_whole()
    with pytest.raises(ContextLengthError, match="pool holds 192"):
        small.add_request("huge", [1] * 100, greedy(100))  # 200 tokens of KV > 12 blocks of 16
    del small
    mx.clear_cache()
