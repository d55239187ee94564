"""Hostile input against a real `mlxd serve`: every defect below failed on the code before it was fixed.

Each is a 4xx in the route's error shape, the engine process is the same one
afterwards, and the server goes on answering normal requests.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.servers import Gateway, assert_error
from tests.e2e.serve_harness import SMALL, Serve

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# The same fields on each generation route: (path, body without them, Anthropic's error shape?)
ROUTES = [
    ("/v1/chat/completions", CHAT, False),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, False),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, True),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, False),
]
HUGE = [1 << 63, (1 << 64) - 1, 1 << 64, 1 << 70, -(1 << 70)]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = Serve(tmp_path_factory.mktemp("hostile"), *SMALL).start().wait_healthy()
    s.pid = s.engine_pid()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(serve):
    # One keep-alive connection for the whole module: every refusal must leave it usable.
    with httpx.Client(base_url=serve.url, timeout=60) as c:
        yield c


def assert_still_serving(serve, http):
    assert serve.engine_pid() == serve.pid, "the engine was replaced"
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path,base,anthropic", ROUTES, ids=[r[0] for r in ROUTES])
@pytest.mark.parametrize("value", HUGE + [49153])
def test_a_top_k_beyond_the_vocabulary_is_400_on_every_generation_route(serve, http, path, base, anthropic,
                                                                         value):
    # 2**63 made the engine's sampler throw std::bad_cast and the engine die; 2**64 broke msgpack.
    err = assert_error(http.post(path, json={**base, "top_k": value}), anthropic)
    if not anthropic:
        assert err["param"] == "top_k"
    assert_still_serving(serve, http)


@pytest.mark.parametrize("path,base", [r[:2] for r in ROUTES[:2]], ids=["chat", "completions"])
@pytest.mark.parametrize("field,value,param", [
    ("seed", 1 << 64, "seed"), ("seed", -(1 << 64), "seed"), ("seed", (1 << 63) - 1, "seed"),
    ("priority", 1 << 63, "priority"), ("priority", -(1 << 70), "priority"),
    ("max_tokens", 1 << 70, "max_tokens"), ("min_tokens", 1 << 70, "min_tokens"),
    ("stop_token_ids", [1 << 70], "stop_token_ids"), ("logit_bias", {str(1 << 70): 1}, "logit_bias"),
    ("logit_bias", {"1": 1e300}, "logit_bias"), ("n", 1 << 70, "n"), ("temperature", 1e308, "temperature"),
    ("repetition_penalty", 1e308, "repetition_penalty"),
])
def test_numbers_past_their_range_are_400_naming_the_field(serve, http, path, base, field, value, param):
    body = {**base, field: value}
    if field == "seed" and value == (1 << 63) - 1:
        body["n"] = 2  # the second choice's seed is seed + 1
    err = assert_error(http.post(path, json=body), False)
    assert err["param"] == param
    assert_still_serving(serve, http)


def test_seed_two_to_the_64_minus_one_with_n_two_is_400(serve, http):
    err = assert_error(http.post("/v1/chat/completions", json={**CHAT, "seed": (1 << 64) - 1, "n": 2}), False)
    assert err["param"] == "seed"
    assert_still_serving(serve, http)


@pytest.mark.parametrize("path,base,anthropic", ROUTES, ids=[r[0] for r in ROUTES])
def test_json_nested_a_thousand_deep_is_400(serve, http, path, base, anthropic):
    deep = "[" * 1000 + "]" * 1000
    body = httpx.Request("POST", "/", json=base).content.decode()[:-1] + f', "metadata": {{"x": {deep}}}}}'
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert "nest" in assert_error(r, anthropic)["message"]
    assert_still_serving(serve, http)


def test_deeply_nested_tool_call_arguments_are_400(serve, http):
    args = '{"a":' * 2000 + "1" + "}" * 2000
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    err = assert_error(http.post("/v1/chat/completions", json={**CHAT, "messages": messages}), False)
    assert err["param"] == "messages[1].tool_calls[0].function.arguments"
    assert_still_serving(serve, http)


@pytest.mark.parametrize("role", ["wizard", "function", "", "System"])
def test_unknown_chat_roles_are_400_not_written_into_the_prompt(serve, http, role):
    body = {**CHAT, "messages": [{"role": role, "content": "hi"}]}
    assert assert_error(http.post("/v1/chat/completions", json=body), False)["param"] == "messages[0].role"
    r = http.post("/tokenize", json={"messages": [{"role": role, "content": "hi"}]})
    assert assert_error(r, False)["param"] == "messages[0].role"


def test_the_developer_role_is_a_system_turn(serve, http):
    dev = http.post("/tokenize", json={"messages": [{"role": "developer", "content": "Be brief."}]}).json()
    system = http.post("/tokenize", json={"messages": [{"role": "system", "content": "Be brief."}]}).json()
    assert dev["tokens"] == system["tokens"]


def test_a_thousand_prompts_in_one_request_are_400_not_a_full_queue(serve, http):
    r = http.post("/v1/completions", json={"prompt": ["hi"] * 1000, "max_tokens": 2})
    assert assert_error(r, False)["param"] == "prompt"
    r = http.post("/v1/completions", json={"prompt": ["hi"] * 40, "max_tokens": 2, "n": 2})
    assert_error(r, False)
    assert_still_serving(serve, http)
    stats = http.get("/health", params={"fresh": 1}).json()["engine"]
    assert stats["num_waiting"] == 0


def test_a_request_chat_template_is_refused_without_the_trust_flag(serve, http):
    body = {**CHAT, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    assert assert_error(http.post("/v1/chat/completions", json=body), False)["param"] == "chat_template"


def test_a_trusted_request_template_is_stopped_by_the_step_cap(serve, http, tmp_path):
    g = Gateway(serve.endpoint, str(tmp_path / "gateway.log"), extra=["--trust-request-chat-template"]).start()
    try:
        g.wait_healthy()
        ok = {**CHAT, "max_tokens": 2, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
        assert httpx.post(g.url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
        # 10**15 iterations: it would never finish.
        loops = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}" \
                "{% endfor %}{% endfor %}{% endfor %}"
        r = httpx.post(g.url + "/v1/chat/completions", json={**CHAT, "chat_template": loops}, timeout=120)
        err = assert_error(r, False)
        assert err["param"] == "chat_template" and "steps" in err["message"]
        assert httpx.post(g.url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
    finally:
        g.stop()


def test_a_prompt_too_long_in_bytes_is_refused_before_it_is_tokenized(serve, http):
    # 10 MB: once 30 s of tokenizing on the event loop and 1.1 GB kept by the gateway.
    big = "a" * (10 << 20)
    for path, body in (("/v1/completions", {"prompt": big}), ("/v1/chat/completions",
                                                              {**CHAT, "messages": [{"role": "user", "content": big}]}),
                       ("/v1/responses", {"input": big})):
        err = assert_error(http.post(path, json=body), False)
        assert err["code"] == "context_length_exceeded" and "bytes" in err["message"]
    assert_still_serving(serve, http)


@pytest.mark.parametrize("host", ["evil.example", "attacker.com:8000", "127.0.0.1.nip.io"])
def test_a_foreign_host_name_is_403_dns_rebinding(serve, http, host):
    r = http.post("/v1/chat/completions", json=CHAT, headers={"host": host})
    assert assert_error(r, False, 403)["type"] == "permission_error"
    r = http.post("/v1/messages", json=ROUTES[2][1], headers={"host": host})
    assert assert_error(r, True, 403)["type"] == "permission_error"


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "[::1]:80", "app.localhost"])
def test_loopback_host_names_are_served(serve, http, host):
    assert http.get("/v1/models", headers={"host": host}).status_code == 200


def test_a_cross_origin_browser_request_is_403(serve, http):
    r = http.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://evil.example"})
    assert_error(r, False, 403)
    assert_error(http.get("/v1/models", headers={"origin": "null"}), False, 403)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_not_declared_json_is_415(serve, http, content_type):
    import json

    headers = {} if content_type is None else {"content-type": content_type}
    r = http.post("/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
    assert assert_error(r, False, 415)["code"] == "unsupported_media_type"
    r = http.post("/v1/messages", content=json.dumps(ROUTES[2][1]), headers=headers)
    assert_error(r, True, 415)


def test_an_allowed_origin_is_served_with_cors(serve, tmp_path):
    g = Gateway(serve.endpoint, str(tmp_path / "gateway.log"),
                extra=["--allowed-origins", "https://app.example"]).start()
    try:
        g.wait_healthy()
        r = httpx.post(g.url + "/v1/chat/completions", json=CHAT, timeout=60,
                       headers={"origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.post(g.url + "/v1/chat/completions", json=CHAT, timeout=60,
                       headers={"origin": "https://other.example"})
        assert_error(r, False, 403)
    finally:
        g.stop()


def test_listening_beyond_loopback_without_a_key_warns(serve, tmp_path):
    g = Gateway(serve.endpoint, str(tmp_path / "open.log"), extra=["--host", "0.0.0.0"]).start()
    keyed = Gateway(serve.endpoint, str(tmp_path / "keyed.log"), extra=["--host", "0.0.0.0", "--api-key", "k"]).start()
    try:
        g.wait_healthy()
        keyed.wait_healthy()
    finally:
        g.stop()
        keyed.stop()
    assert "listening on 0.0.0.0 with no API key" in (tmp_path / "open.log").read_text()
    assert "with no API key" not in (tmp_path / "keyed.log").read_text()


def test_a_request_head_or_body_left_unfinished_is_dropped(serve, tmp_path):
    import socket

    g = Gateway(serve.endpoint, str(tmp_path / "gateway.log"), extra=["--request-timeout", "1"]).start()
    try:
        g.wait_healthy()
        with socket.create_connection(("127.0.0.1", g.port), timeout=60) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
            assert s.recv(1024) == b""  # closed by the server, with nothing sent
        with socket.create_connection(("127.0.0.1", g.port), timeout=60) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\"")
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b'"code":"request_timeout"' in answer
        assert httpx.post(g.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    finally:
        g.stop()


def test_deeply_nested_function_call_arguments_are_400_on_responses(serve, http):
    args = "[" * 2000 + "]" * 2000
    item = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": ' + args + "}"}
    r = http.post("/v1/responses", json={"input": [item], "max_output_tokens": 2})
    assert assert_error(r, False)["param"] == "input[0].arguments"
    assert_still_serving(serve, http)


@pytest.mark.parametrize("content", [5, {"text": "x"}, True])
def test_an_anthropic_tool_result_whose_content_is_not_text_is_400(serve, http, content):
    messages = [{"role": "user", "content": "add"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": content}]}]
    r = http.post("/v1/messages", json={"messages": messages, "max_tokens": 2})
    assert_error(r, True)
    assert_still_serving(serve, http)


def test_the_kv_pool_refusal_names_the_field_of_each_api(tmp_path):
    from tests.e2e.servers import Engine, free_port

    # 8 blocks of 16 tokens: a short prompt fits the context of 512 but not with 300 more tokens.
    e = Engine(f"tcp://127.0.0.1:{free_port()}", str(tmp_path / "engine.log"), extra=["--num-kv-blocks", "8"]).start()
    g = Gateway(e.endpoint, str(tmp_path / "gateway.log")).start()
    try:
        g.wait_healthy()
        cases = [("/v1/chat/completions", {**CHAT, "max_tokens": 300}, "max_tokens"),
                 ("/v1/chat/completions", {**CHAT, "max_tokens": None, "max_completion_tokens": 300},
                  "max_completion_tokens"),
                 ("/v1/chat/completions", {**CHAT, "max_tokens": None}, "messages"),
                 ("/v1/completions", {"prompt": "hi", "max_tokens": 300}, "max_tokens"),
                 ("/v1/responses", {"input": "hi", "max_output_tokens": 300}, "max_output_tokens")]
        for path, body, param in cases:
            err = assert_error(httpx.post(g.url + path, json=body, timeout=60), False)
            assert err["code"] == "context_length_exceeded" and err["param"] == param, (path, err)
    finally:
        g.stop()
        e.stop()


def test_the_event_loop_answers_while_a_template_renders(serve, tmp_path):
    import json
    import socket

    g = Gateway(serve.endpoint, str(tmp_path / "gateway.log"), extra=["--trust-request-chat-template"]).start()
    try:
        g.wait_healthy()
        # About 10**7 loop steps: seconds of rendering, then the step cap's 400.
        slow = "{% for a in range(4000) %}{% for b in range(4000) %}{% endfor %}{% endfor %}"
        body = json.dumps({**CHAT, "chat_template": slow}).encode()
        with socket.create_connection(("127.0.0.1", g.port), timeout=120) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            # Answered while the render is still running: the slow request has no answer yet.
            assert httpx.get(g.url + "/health", timeout=120).status_code == 200
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
            s.setblocking(True)
            assert s.recv(64).startswith(b"HTTP/1.1 400")
    finally:
        g.stop()
