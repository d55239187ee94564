"""An engine killed mid-stream: streams fail fast, /health says 503, and service resumes by itself."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.e2e.servers import Engine, Gateway, free_port

LONG = dict(messages=[{"role": "user", "content": "Write a long poem about autumn."}],
            max_tokens=400, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(params=["tcp", "ipc"])
def pair(request, tmp_path):
    """A private engine + gateway (these tests kill the engine), over TCP and over a unix socket."""
    if request.param == "tcp":
        endpoint = f"tcp://127.0.0.1:{free_port()}"
    else:
        endpoint = f"ipc://{tmp_path}/engine.sock"
    engine = Engine(endpoint, str(tmp_path / "engine.log")).start()
    gateway = Gateway(endpoint, str(tmp_path / "gateway.log")).start()
    gateway.wait_healthy()
    yield engine, gateway
    gateway.stop()
    engine.stop()


def _stream_in_background(client, model):
    """Start a long stream; returns (thread, record) where record gets chunks, error, end time."""
    record = {"chunks": 0, "error": None, "ended": None}
    started = threading.Event()

    def run():
        try:
            for _ in client.chat.completions.create(model=model, stream=True, **LONG):
                record["chunks"] += 1
                if record["chunks"] >= 3:
                    started.set()
        except Exception as e:  # what the SDK raises for the error event
            record["error"] = e
        finally:
            record["ended"] = time.monotonic()
            started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(120) and record["error"] is None
    return t, record


def test_kill9_mid_stream_fails_streams_fast_and_gateway_reconnects(pair):
    engine, gateway = pair
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    streams = [_stream_in_background(client, model) for _ in range(2)]

    killed = time.monotonic()
    engine.kill9()
    for t, record in streams:
        t.join(5)
        assert record["ended"] is not None, "stream still open after the engine died"
        assert record["ended"] - killed < 2.0
        assert isinstance(record["error"], openai.APIError)
        assert "engine" in str(record["error"])

    r = gateway.health()
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=model, messages=LONG["messages"], max_tokens=3)
    assert e.value.status_code == 503 and e.value.body["code"] == "engine_unavailable"

    # A new engine on the same endpoint; the same gateway process picks it up.
    gateway_pid = gateway.proc.pid
    engine.start()
    gateway.wait_healthy()
    assert gateway.proc.pid == gateway_pid and gateway.proc.poll() is None
    r = client.chat.completions.create(model=model, messages=LONG["messages"], max_tokens=4)
    assert r.choices[0].message.content


def test_sigterm_ends_streams_with_an_error_and_the_engine_exits_cleanly(pair):
    engine, gateway = pair
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    t, record = _stream_in_background(client, model)
    stopped = time.monotonic()
    # --shutdown-timeout 1: the 400-token stream cannot finish and is aborted.
    assert engine.stop() == 0
    t.join(5)
    assert record["ended"] is not None and record["ended"] - stopped < 5
    assert isinstance(record["error"], openai.APIError)
    assert "SIGTERM" in str(record["error"])
    deadline = time.monotonic() + 3
    while gateway.health().status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "SIGTERM" in httpx.get(gateway.url + "/health").json()["reason"]


def test_gateway_started_before_the_engine_answers_503_then_serves(tmp_path):
    endpoint = f"ipc://{tmp_path}/later.sock"
    gateway = Gateway(endpoint, str(tmp_path / "gateway.log")).start()
    engine = Engine(endpoint, str(tmp_path / "engine.log"))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = gateway.health()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        err = httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert err.status_code == 503 and err.json()["error"]["code"] == "engine_unavailable"
        engine.start()
        gateway.wait_healthy()
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="Hello", max_tokens=3).choices[0].text is not None
    finally:
        gateway.stop()
        engine.stop()
