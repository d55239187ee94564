"""Edges of HTTP that a real gateway answers in its API's error shape: request heads over 64 KiB (431),
a trailing slash (the route itself), a non-JSON POST to a path no route serves (404), a tool message
without ``tool_call_id`` (400); and a start-up that prints none of transformers' advice."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest

from tests.e2e.servers import Gateway, _env, assert_error

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
HEAD_LIMIT = 64 << 10


def _raw(gateway, pieces: list[bytes]) -> bytes:
    """Send ``pieces`` one by one on a fresh connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as s:
        for piece in pieces:
            s.sendall(piece)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def _answer(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("path,anthropic", [("/v1/chat/completions", False), ("/v1/messages", True)])
def test_a_70_kb_header_is_431_in_the_routes_error_shape(gateway, path, anthropic):
    body = {**CHAT, "model": "m"}
    r = httpx.post(gateway.url + path, json=body, headers={"x-padding": "p" * 70_000}, timeout=30)
    assert "64 KiB" in assert_error(r, anthropic, 431)["message"]
    assert r.headers["content-type"] == "application/json"


def test_a_bearer_token_of_100000_characters_is_431(gateway):
    r = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30,
                   headers={"authorization": "Bearer " + "t" * 100_000})
    assert assert_error(r, False, 431)["code"] == "request_header_too_large"


def test_a_head_still_growing_past_64_kib_is_answered_431_before_it_ends(gateway):
    """The head never ends: the server answers at the limit, and the client reads it (no reset)."""
    start = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    status, headers, body = _answer(_raw(gateway, [start, b"x-a: " + b"a" * 40_000 + b"\r\n",
                                                    b"x-b: " + b"b" * 40_000 + b"\r\n"]))
    assert status == 431 and headers["content-type"] == "application/json", (status, headers, body)
    assert b'"code":"request_header_too_large"' in body


def test_a_head_under_64_kib_sent_in_pieces_is_served(gateway):
    header = b"x-a: " + b"a" * (HEAD_LIMIT - 8_000) + b"\r\n"
    status, _, body = _answer(_raw(gateway, [b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n", header[:30_000],
                                             header[30_000:], b"Connection: close\r\n\r\n"]))
    assert status == 200, body
    assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200


def test_a_trailing_slash_is_the_route_itself(gateway):
    r = httpx.post(gateway.url + "/v1/chat/completions/", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    model = httpx.get(gateway.url + "/v1/models/", timeout=10).json()["data"][0]["id"]
    assert httpx.get(gateway.url + f"/v1/models/{model}/", timeout=10).json()["id"] == model
    assert_error(httpx.get(gateway.url + "/v1/nothing/", timeout=10), False, 404)


@pytest.mark.parametrize("path,anthropic", [("/v1/nothing", False), ("/v1/messages/nothing", True)])
def test_a_multipart_post_to_a_path_no_route_serves_is_404(gateway, path, anthropic):
    r = httpx.post(gateway.url + path, files={"file": ("a.txt", b"hello")}, timeout=10)
    assert_error(r, anthropic, 404)
    # A path that is served keeps refusing a body that is not JSON.
    r = httpx.post(gateway.url + "/v1/chat/completions", files={"file": ("a.txt", b"hello")}, timeout=10)
    assert assert_error(r, False, 415)["code"] == "unsupported_media_type"


def test_a_tool_message_without_tool_call_id_is_400(gateway):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny"}]
    r = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "messages": messages}, timeout=60)
    assert assert_error(r, False, 400)["param"] == "messages[2].tool_call_id"
    messages[2]["tool_call_id"] = "c1"
    assert httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "messages": messages},
                      timeout=60).status_code == 200


class _GatewayWithoutTorch(Gateway):
    """The gateway where torch is not installed (mlxd does not depend on it; the tests do)."""

    def start(self) -> "Gateway":
        self._log = open(self.log_path, "ab")
        hide_torch = "import sys; sys.modules['torch'] = None; from mlxd.cli import main; sys.exit(main())"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", hide_torch, "gateway", "--engine-endpoint", self.endpoint,
             "--port", str(self.port), *self.extra],
            stdout=self._log, stderr=subprocess.STDOUT, env=_env())
        return self


def test_the_gateway_starts_without_transformers_advice_about_torch(engine, tmp_path):
    g = _GatewayWithoutTorch(engine.endpoint, str(tmp_path / "gateway.log")).start()
    try:
        g.wait_healthy()  # the model's tokenizer is loaded by then
        assert httpx.post(g.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    finally:
        g.stop()
    log = (tmp_path / "gateway.log").read_text()
    assert "mlxd gateway" in log
    assert "PyTorch" not in log, log
