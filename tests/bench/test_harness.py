"""The load generator's outcome counts against a real engine + gateway, a closed port, and broken servers."""

from __future__ import annotations

import dataclasses
import http.server
import threading

import pytest

from mlxd.bench.agent import loadgen, report, workload
from mlxd.bench.agent.peers import served_model
from tests.e2e.servers import Engine, Gateway, free_port


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    e = Engine(f"tcp://127.0.0.1:{free_port()}", str(logs / "engine.log")).start()
    g = Gateway(e.endpoint, str(logs / "gateway.log")).start()
    try:
        g.wait_healthy()
        yield g
    finally:
        g.stop()
        e.stop()


def _tiny(split: str, n: int, max_tokens: int = 8):
    sessions = workload.make(split, n, 0.1, seed=1, turns=2)
    for s in sessions:
        for r in s:
            r.max_tokens = max_tokens  # the gateway's test engine allows 512 tokens of context
    return sessions


def test_every_request_against_a_real_server_succeeds_with_counted_tokens(gateway):
    sessions = _tiny("chat", 3)
    model = served_model(gateway.url)
    results, wall = loadgen.run(gateway.url, model, sessions, concurrency=2, timeout=120)
    s = report.summarize(results, wall)
    assert (s["requests"], s["ok"], s["http_error"], s["dropped"], s["empty"]) == (3, 3, 0, 0, 0), s["errors"]
    # usage came through include_usage: real prompt counts, at most max_tokens out per request
    assert all(r.prompt_tokens > 10 and 1 <= r.output_tokens <= 8 for r in results)
    assert s["output_tokens"] == sum(r.output_tokens for r in results)
    assert 0 < s["ttft_p50"] <= s["e2e_p50"] and s["total_tok_s"] > s["output_tok_s"] > 0


def test_open_loop_sessions_start_at_their_poisson_times_whatever_is_running(gateway):
    """``--rate``: each session starts at its arrival time, not when an earlier one ends; a session's
    turns still follow one another."""
    seed = 7
    print(f"arrival seed {seed}")
    chats = [s[0] for s in _tiny("chat", 6)]  # short prompts: the test engine's context is 512 tokens
    sessions = [[dataclasses.replace(chats[2 * i + t], session=i, turn=t) for t in (0, 1)] for i in range(3)]
    arrivals = loadgen.arrival_times(len(sessions), rate=8.0, seed=seed)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    results, wall = loadgen.run(gateway.url, served_model(gateway.url), sessions, concurrency=1, timeout=120,
                                rate=8.0, seed=seed)
    s = report.summarize(results, wall)
    assert (s["requests"], s["ok"]) == (6, 6), s["errors"]
    first = {r.session: r.start for r in results if r.turn == 0}
    t0 = first[sessions[0][0].session]
    for session, arrival in zip(sessions, arrivals):
        # on time: not held back until an earlier session ends (the client's own lag is milliseconds)
        assert arrival - 0.005 <= first[session[0].session] - t0 <= arrival + 0.1
    by_session = {}
    for r in results:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        a, b = sorted(turns, key=lambda r: r.turn)
        assert b.start >= a.end  # the second turn waited for the first


def test_a_closed_port_counts_http_errors_not_successes():
    results, wall = loadgen.run(f"http://127.0.0.1:{free_port()}", "m", _tiny("agent", 4), concurrency=2)
    s = report.summarize(results, wall)
    assert (s["requests"], s["ok"], s["http_error"], s["dropped"], s["empty"]) == (4, 0, 4, 0, 0)
    assert s["ttft_p50"] is None and s["output_tok_s"] == 0


class _Broken(http.server.BaseHTTPRequestHandler):
    """Answers by path: a stream cut before its finish, a finished stream with no text, or a 500."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        mode = self.server.mode
        if mode == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "boom"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if mode == "drop":
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n')
        else:  # empty
            self.wfile.write(b'data: {"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]}\n\n'
                             b"data: [DONE]\n\n")

    def log_message(self, *a):
        pass


@pytest.mark.parametrize("mode,outcome", [("drop", "dropped"), ("empty", "empty"), ("500", "http_error")])
def test_broken_streams_are_counted_apart(mode, outcome):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    srv.mode = mode
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        results, wall = loadgen.run(f"http://127.0.0.1:{srv.server_address[1]}", "m", _tiny("chat", 2), 2)
    finally:
        srv.shutdown()
    s = report.summarize(results, wall)
    assert s[outcome] == 2 and s["ok"] == 0 and s["requests"] == 2


def test_agent_sessions_share_the_system_prompt_and_grow_with_tool_results():
    sessions = workload.make("agent", 8, 1.0, seed=0, turns=4)
    assert [len(s) for s in sessions] == [4, 4]
    system = {s[0].messages[0]["content"] for s in sessions}
    assert len(system) == 1 and "read_file" in system.pop()
    for s in sessions:
        sizes = [r.approx_input_tokens for r in s]
        assert sizes == sorted(sizes) and 800 <= sizes[0] <= 1300 and 4000 <= sizes[-1] <= 6000
        assert all(20 <= r.max_tokens <= 200 for r in s)
        last = s[-1].messages
        assert any(m["role"] == "tool" for m in last) and any("<tool_call>" in m["content"] for m in last)
        # each turn's prompt extends the previous one: what a prefix cache can reuse
        assert s[1].messages[:len(s[0].messages)] == s[0].messages
    small = workload.make("agent", 4, 0.25, seed=0, turns=4)[0]
    assert small[-1].approx_input_tokens < sessions[0][-1].approx_input_tokens / 2


def test_two_seeds_requests_share_no_cached_prefix_and_the_usage_reports_what_was_cached(gateway):
    """A sweep's runs draw their requests from seeds of their own: one seed's request finds nothing of
    another's in the server's prefix cache (a run is not served from an earlier run's prompts), while the
    same requests sent again are, and the usage's count of it reaches the results and the summary."""
    model = served_model(gateway.url)

    def chats(seed: int, n: int):
        sessions = workload.make("chat", n, 0.1, seed=seed)
        for s in sessions:
            s[0].max_tokens = 4
        return sessions

    first = chats(11, 2)
    results, _ = loadgen.run(gateway.url, model, first, concurrency=1, timeout=120)
    assert [r.outcome for r in results] == ["ok", "ok"], [r.detail for r in results]
    results, wall = loadgen.run(gateway.url, model, chats(12, 1), concurrency=1, timeout=120)
    assert results[0].outcome == "ok" and results[0].prompt_tokens > 16 and results[0].cached_tokens == 0
    again, wall = loadgen.run(gateway.url, model, first, concurrency=1, timeout=120)
    assert all(r.outcome == "ok" and r.cached_tokens >= 16 for r in again), [(r.detail, r.cached_tokens) for r in again]
    assert report.summarize(again, wall)["cached_tokens"] == sum(r.cached_tokens for r in again)
