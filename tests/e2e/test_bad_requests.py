"""Bad input gets its 4xx with an OpenAI error body, and never disturbs requests in flight."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.e2e.servers import Gateway

GOOD = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6, "temperature": 0}


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def _post(gateway, body, path="/v1/chat/completions", **kw):
    if isinstance(body, (bytes, str)):
        return httpx.post(gateway.url + path, content=body, timeout=30,
                          headers={"content-type": "application/json"}, **kw)
    return httpx.post(gateway.url + path, json=body, timeout=30, **kw)


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2", "{\"messages\": [}".encode()])
def test_malformed_json_is_400(gateway, body):
    err = _error(_post(gateway, body), 400)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "5"), ("temperature", "hot"), ("messages", "hello"), ("n", 1.5),
    ("stream", "yes"), ("stop", 3), ("seed", [1]),
])
def test_wrong_types_are_400_naming_the_field(gateway, field, value):
    _error(_post(gateway, {**GOOD, field: value}), 400, param=field)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("max_completion_tokens", -5), ("temperature", -0.5),
    ("top_p", 0), ("n", 0), ("top_k", -2), ("presence_penalty", 3.0),
    ("logit_bias", {"999999": 1.0}), ("top_logprobs", 50),
])
def test_out_of_range_values_are_400(gateway, field, value):
    body = {**GOOD, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    _error(_post(gateway, body), 400)


def test_missing_messages_is_400(gateway):
    _error(_post(gateway, {"max_tokens": 3}), 400, param="messages")


def test_over_long_prompt_is_400_context_length(client, model, gateway):
    long = "word " * 700  # over the e2e engine's max_model_len of 512
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": long}],
                                       max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=long, max_tokens=4)
    # Fits alone but not with what it asks to generate.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="word " * 300, max_tokens=400)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=GOOD["messages"], max_tokens=3)
    assert e.value.body["code"] == "model_not_found"


def test_unknown_route_and_method_are_openai_errors(gateway):
    _error(httpx.get(gateway.url + "/v1/nothing"), 404)
    _error(httpx.get(gateway.url + "/v1/chat/completions"), 405)


def test_bad_api_key_is_401(engine, tmp_path):
    g = Gateway(engine.endpoint, str(tmp_path / "gateway-key.log"), extra=["--api-key", "sekret"]).start()
    try:
        g.wait_healthy()
        bad = openai.OpenAI(base_url=g.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="x", messages=GOOD["messages"], max_tokens=3)
        _error(httpx.post(g.url + "/v1/completions", json={"prompt": "hi"}), 401)
        good = openai.OpenAI(base_url=g.url + "/v1", api_key="sekret", max_retries=0)
        model = good.models.list().data[0].id
        assert good.completions.create(model=model, prompt="Hi", max_tokens=3).choices[0].text is not None
    finally:
        g.stop()


def test_bad_requests_do_not_disturb_a_stream_in_flight(client, model, gateway):
    kw = dict(model=model, messages=[{"role": "user", "content": "Tell me about rivers."}],
              max_tokens=24, temperature=0)
    expected = client.chat.completions.create(**kw).choices[0].message.content
    got: list[str] = []

    def stream():
        for ch in client.chat.completions.create(stream=True, **kw):
            for c in ch.choices:
                got.append(c.delta.content or "")

    t = threading.Thread(target=stream)
    t.start()
    for body in (b"{oops", {**GOOD, "max_tokens": -3}, {**GOOD, "model": "nope"},
                 {**GOOD, "messages": [{"role": "user", "content": "x " * 700}]}, {**GOOD, "n": "two"}):
        assert 400 <= _post(gateway, body).status_code < 500
    t.join(120)
    assert "".join(got) == expected
    # And the engine still serves.
    assert client.chat.completions.create(**kw).choices[0].message.content == expected


def test_oversized_body_is_413(gateway, client, model):
    from mlxd.gateway.state import MAX_BODY_BYTES

    big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 16) + b'"}'
    err = _error(_post(gateway, big, path="/v1/completions"), 413)
    assert err["code"] == "request_too_large"
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text is not None
