"""The OpenAI API through the official SDK against a real engine + gateway pair."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPT = "The three primary colours are"


def _chat(client, model, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=kw.pop("messages", CHAT), **kw)


def _stream_chat(client, model, **kw):
    """(list of content deltas, finish_reason, usage, chunks)"""
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    chunks = list(client.chat.completions.create(model=model, messages=kw.pop("messages", CHAT),
                                                 stream=True, **kw))
    deltas, finish, usage = [], None, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.content:
                deltas.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    return deltas, finish, usage, chunks


def test_models_lists_the_served_model(client, model):
    assert model
    assert [m.id for m in client.models.list().data] == [model]


def test_chat_completion_returns_text_and_usage(client, model):
    r = _chat(client, model)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content.strip()
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == model and r.id.startswith("chatcmpl-")


def test_chat_stream_equals_non_stream_with_role_first_and_usage_last(client, model):
    whole = _chat(client, model)
    deltas, finish, usage, chunks = _stream_chat(client, model, stream_options={"include_usage": True})
    assert "".join(deltas) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    # include_usage: a final chunk with no choices carries the usage; the others carry null.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage_chunk(client, model):
    _, _, usage, chunks = _stream_chat(client, model)
    assert usage is None and all(ch.choices for ch in chunks)


def test_completion_stream_equals_non_stream(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    text = whole.choices[0].text
    assert text and whole.usage.completion_tokens == 10
    parts = [c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == text


def _post(gateway, path, body):
    r = httpx.post(gateway.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_accepts_token_ids_and_several_prompts(client, model, gateway):
    ids = _post(gateway, "/tokenize", {"prompt": PROMPT})["tokens"]
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    two = client.completions.create(model=model, prompt=[PROMPT, "Paris is"], max_tokens=6,
                                    temperature=0)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == by_text.choices[0].text


def test_stop_string_across_token_boundary_is_cut_and_not_emitted(client, model):
    deltas, _, _, _ = _stream_chat(client, model, max_tokens=16)
    full = "".join(deltas)
    # A stop string that starts inside one streamed piece and ends inside the next.
    i = next(k for k in range(1, len(deltas)) if len(deltas[k - 1]) >= 2 and len(deltas[k]) >= 2)
    start = len("".join(deltas[:i])) - 1
    stop = full[start:start + 3]
    expected = full[:full.find(stop)]
    r = _chat(client, model, max_tokens=16, stop=[stop])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    s_deltas, s_finish, _, _ = _stream_chat(client, model, max_tokens=16, stop=stop)
    assert "".join(s_deltas) == expected and s_finish == "stop"


def test_n2_gives_two_indexed_choices_reproducible_with_a_seed(client, model):
    kw = dict(n=2, temperature=1.0, seed=7, max_tokens=12)
    a = _chat(client, model, **kw)
    b = _chat(client, model, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    # Choices of one request get distinct seeds.
    assert a.choices[0].message.content != a.choices[1].message.content
    # Usage counts both choices' tokens, the prompt once.
    assert 2 <= a.usage.completion_tokens <= 24
    assert a.usage.prompt_tokens == _chat(client, model).usage.prompt_tokens
    deltas = {0: [], 1: []}
    for ch in client.chat.completions.create(model=model, messages=CHAT, stream=True, **kw):
        for c in ch.choices:
            deltas[c.index].append(c.delta.content or "")
    assert ["".join(deltas[i]) for i in (0, 1)] == [c.message.content for c in a.choices]


def test_seed_makes_sampling_reproducible(client, model):
    kw = dict(temperature=1.0, max_tokens=16)
    a = _chat(client, model, seed=123, **kw).choices[0].message.content
    b = _chat(client, model, seed=123, **kw).choices[0].message.content
    c = _chat(client, model, seed=124, **kw).choices[0].message.content
    assert a == b
    assert a != c


def test_chat_logprobs_with_top_alternatives(client, model):
    r = _chat(client, model, logprobs=True, top_logprobs=3, max_tokens=8)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert bytes(t.bytes).decode() == t.token


def test_streamed_chat_logprobs_of_two_choices_equal_the_whole_ones(client, model):
    kw = dict(n=2, temperature=1.0, seed=11, max_tokens=8, logprobs=True, top_logprobs=2)
    whole = _chat(client, model, **kw)
    streamed = {0: [], 1: []}
    for ch in client.chat.completions.create(model=model, messages=CHAT, stream=True, **kw):
        for c in ch.choices:
            if c.logprobs is not None:
                streamed[c.index] += c.logprobs.content
    for c in whole.choices:
        assert [t.token for t in streamed[c.index]] == [t.token for t in c.logprobs.content]
        assert [t.logprob for t in streamed[c.index]] == pytest.approx([t.logprob for t in c.logprobs.content],
                                                                       abs=1e-3)


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(d) == 2 for d in lp.top_logprobs)


def test_16_concurrent_streams_equal_sequential_greedy_runs(client, model):
    prompts = [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(16)]

    def run(messages) -> str:
        deltas, _, _, _ = _stream_chat(client, model, messages=messages, max_tokens=10)
        return "".join(deltas)

    sequential = [run(m) for m in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        concurrent_ = list(pool.map(run, prompts))
    assert concurrent_ == sequential
    assert len(set(sequential)) > 1


def test_tokenize_detokenize_round_trip(gateway):
    ids = _post(gateway, "/tokenize", {"prompt": "héllo wörld 😀", "add_special_tokens": False})
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 512
    text = _post(gateway, "/detokenize", {"tokens": ids["tokens"]})["prompt"]
    assert text == "héllo wörld 😀"


def test_sse_keepalive_comments_during_a_long_prefill(engine, tmp_path):
    from tests.e2e.servers import Gateway

    g = Gateway(engine.endpoint, str(tmp_path / "gateway-ka.log"), extra=["--sse-keepalive", "0.02"]).start()
    try:
        g.wait_healthy()
        # ~420 prompt tokens prefill in chunks of 256 (--max-num-batched-tokens): well over 20 ms.
        body = {"prompt": "lorem ipsum dolor " * 60, "max_tokens": 2, "stream": True}
        with httpx.stream("POST", g.url + "/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        assert ": keep-alive" in lines
        assert lines[-1] == "data: [DONE]"
        # Comments never break the SDK's parsing of the same stream.
        sdk = __import__("openai").OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
        body.pop("stream")
        parts = [c.choices[0].text for c in sdk.completions.create(model=engine_model(g), stream=True, **body)
                 if c.choices]
        assert len(parts) >= 1
    finally:
        g.stop()


def engine_model(g) -> str:
    return httpx.get(g.url + "/v1/models").json()["data"][0]["id"]


def test_cached_tokens_reported_and_cache_salt_isolates(client, model):
    messages = [{"role": "user", "content": "Repeat after me: " + "alpha beta gamma delta " * 12}]

    def cached(**extra) -> int:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                           extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() >= 16  # at least one full block of the prompt came from the prefix cache
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-b") >= 16
