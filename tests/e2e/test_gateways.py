"""Several gateways on one engine; a client or a gateway that goes away frees its KV blocks."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import openai

from tests.e2e.servers import Gateway

LONG = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}


def _engine_stats(gateway) -> dict:
    return gateway.health(fresh=True).json()["engine"]


def _wait_idle(gateway, timeout: float) -> dict:
    """The engine's stats once nothing runs and every block is free; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        s = _engine_stats(gateway)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
            return s
        assert time.monotonic() < deadline, (
            f"engine still busy after {timeout}s: {s}; logs: {gateway.log_path} and the engine's")
        time.sleep(0.1)


def _start_long_stream(gateway):
    """A stream that would run for tens of seconds, read until it is generating.

    Returns (client, response, line iterator); the iterator must stay referenced:
    httpx closes the connection when it is collected.
    """
    http = httpx.Client(timeout=60)
    resp = http.send(http.build_request("POST", gateway.url + "/v1/chat/completions", json=LONG),
                     stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    n = 0
    for line in lines:
        if line.startswith("data: "):
            n += 1
            if n >= 4:
                break
    return http, resp, lines


def test_two_gateways_share_one_engine(engine, gateway, client, model, tmp_path):
    second = Gateway(engine.endpoint, str(tmp_path / "gateway2.log")).start()
    try:
        second.wait_healthy()
        client2 = openai.OpenAI(base_url=second.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert client2.models.list().data[0].id == model
        kw = dict(model=model, messages=[{"role": "user", "content": "Name a fruit."}],
                  max_tokens=8, temperature=0)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda c: c.chat.completions.create(**kw).choices[0].message.content,
                                 [client, client2, client, client2]))
        assert len(set(outs)) == 1 and outs[0]
        # Both see the same engine: a stream held open through one shows in the other's stats.
        http, resp, _lines = _start_long_stream(gateway)
        try:
            assert _engine_stats(second)["num_running"] == 1
        finally:
            resp.close()
            http.close()
        _wait_idle(second, 3)
    finally:
        second.stop()
    # The first gateway is unaffected by the second one leaving.
    assert client.chat.completions.create(**kw).choices[0].message.content == outs[0]


def test_closed_connection_mid_stream_frees_its_blocks(gateway):
    before = _wait_idle(gateway, 30)
    http, resp, _lines = _start_long_stream(gateway)
    busy = _engine_stats(gateway)
    assert busy["num_running"] == 1 and busy["num_free_blocks"] < before["num_total_blocks"]
    resp.close()
    http.close()
    # 400 tokens would take the engine tens of seconds; the abort frees everything at once.
    _wait_idle(gateway, 5)


def _aborted_requests(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mlxd:request_success_total{") and 'finished_reason="abort"' in line)


def test_closed_connection_of_a_non_streamed_request_aborts_it(gateway, metrics_port):
    _wait_idle(gateway, 30)
    aborted = _aborted_requests(metrics_port)
    body = json.dumps({**LONG, "stream": False}).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    # A raw socket, so that the connection closes exactly when the test says: once the engine runs it.
    with socket.create_connection((host, int(port))) as sock:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while _engine_stats(gateway)["num_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    # 400 tokens would take the engine tens of seconds; the abort frees everything well before.
    _wait_idle(gateway, 5)
    assert _aborted_requests(metrics_port) == aborted + 1


def test_requests_of_a_killed_gateway_are_aborted(engine, gateway, tmp_path):
    doomed = Gateway(engine.endpoint, str(tmp_path / "doomed.log")).start()
    doomed.wait_healthy()
    _wait_idle(gateway, 30)
    http, resp, _lines = _start_long_stream(doomed)
    assert _engine_stats(gateway)["num_running"] == 1
    doomed.proc.kill()
    doomed.proc.wait()
    # The engine notices the silence (--gateway-timeout 3) and aborts the orphan.
    _wait_idle(gateway, 6)
    resp.close()
    http.close()
    doomed.stop()


def test_engine_serves_prometheus_metrics_that_count_served_requests(client, model, metrics_port):
    def counter(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith(name + "_created"))

    url = f"http://127.0.0.1:{metrics_port}/metrics"
    before = counter(httpx.get(url).text, "mlxd:generation_tokens_total")
    client.completions.create(model=model, prompt="One two three", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(url).text
    assert counter(text, "mlxd:generation_tokens_total") == before + 5
    assert "mlxd:num_requests_running" in text and 'model_name="' in text
