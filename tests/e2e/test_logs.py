"""Logs an operator reads: one connection line per gateway (queued HELLOs, a restart), one access line per
request with its fields, and vLLM's periodic stats line."""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import openai

from tests.e2e.serve_harness import Serve, gone
from tests.e2e.servers import Engine, Gateway, free_port

CONNECTED = re.compile(r"gateway [0-9a-f]+ connected \(pid \d+\)")
ACCESS = re.compile(r"mlxd\.access: (?P<id>\S+) app=(?P<app>\S+) (?P<method>[A-Z]+) (?P<route>\S+) (?P<status>\d{3}) "
                    r"prompt_tokens=(?P<prompt>\d+) cached_tokens=(?P<cached>\d+) generation_tokens=(?P<gen>\d+) "
                    r"ttft=(?P<ttft>[0-9.]+s|-) duration=(?P<duration>[0-9.]+)s$", re.M)


def _v1_routes(log: str) -> list[tuple[str, str, str]]:
    """(method, route, status) of each access line of an API route, in order."""
    return [(m["method"], m["route"], m["status"]) for m in ACCESS.finditer(log) if m["route"].startswith("/v1/")]


def test_one_connection_line_per_gateway_however_many_hellos_queued(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # The gateways start first: their HELLOs queue up while the engine loads.
    gateways = [Gateway(endpoint, str(tmp_path / f"gateway{i}.log")).start() for i in range(2)]
    engine = Engine(endpoint, str(tmp_path / "engine.log")).start()
    try:
        for g in gateways:
            g.wait_healthy()
    finally:
        for g in gateways:
            g.stop()
        engine.stop()
    log = open(tmp_path / "engine.log").read()
    pids = sorted(int(m) for m in re.findall(r"connected \(pid (\d+)\)", log))
    assert pids == sorted(g.proc.pid for g in gateways), log[-3000:]


def test_serve_logs_one_access_line_per_request_and_one_connection_per_engine_life(tmp_path):
    s = Serve(tmp_path, "--enable-log-requests").start()
    try:
        s.wait_healthy()
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4, temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True}))
        assert chunks
        bad = client.with_options(max_retries=0).completions
        try:
            bad.create(model="no-such-model", prompt="x", max_tokens=2)
        except openai.NotFoundError:
            pass
        assert len(CONNECTED.findall(s.log())) == 1, s.log()[-3000:]
        # A restart: the new engine logs the same gateway once more, not once per HELLO.
        engine_pid = s.wait_engine()
        os.kill(engine_pid, signal.SIGKILL)
        s.wait_engine(not_pid=engine_pid)
        assert gone(engine_pid)
        s.wait_healthy()
        client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
        # The gateway writes a request's line once the response is sent, so the client can have its answer a
        # moment before the line is there: stopping the server then would cut it off.
        deadline = time.monotonic() + 30
        while len(_v1_routes(s.log())) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        s.stop()
    log = s.log()
    assert len(CONNECTED.findall(log)) == 2, log[-3000:]
    lines = [m.groupdict() for m in ACCESS.finditer(log)]
    routes = _v1_routes(log)
    assert routes == [("GET", "/v1/models", "200"), ("POST", "/v1/chat/completions", "200"),
                      ("POST", "/v1/chat/completions", "200"), ("POST", "/v1/completions", "404"),
                      ("POST", "/v1/completions", "200")], log[-3000:]
    generated = [m for m in lines if m["route"] in ("/v1/chat/completions", "/v1/completions") and m["status"] == "200"]
    assert [int(m["gen"]) for m in generated] == [5, 4, 3]
    assert int(generated[0]["prompt"]) == chat.usage.prompt_tokens
    assert chat.id == "chatcmpl-" + generated[0]["id"]
    for m in generated:
        assert m["app"] == "default" and m["ttft"] != "-"
        assert float(m["ttft"][:-1]) <= float(m["duration"])
    assert "Traceback" not in log


def test_serve_without_enable_log_requests_writes_no_access_lines(tmp_path):
    s = Serve(tmp_path, "--disable-log-requests").start()
    try:
        s.wait_healthy()
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt="Hello", max_tokens=2)
    finally:
        s.stop()
    assert not ACCESS.findall(s.log()) and "mlxd.access" not in s.log()


class _Totals:
    total_prompt_tokens = total_cached_tokens = total_generation_tokens = 0
    spec = None  # not speculating
    disk = None  # no KV disk tier


class _Stats:
    num_running, num_waiting, num_free_blocks, num_total_blocks = 3, 1, 30, 40
    prefix_cache_queries, prefix_cache_hits = 200, 50


def test_the_stats_line_reads_like_vllms_and_is_quiet_when_idle(caplog):
    from mlxd.engined.metrics import StatsLog

    totals = _Totals()
    stats = StatsLog(totals)
    with caplog.at_level(logging.DEBUG, logger="mlxd.engine"):
        assert stats.maybe_log(100.0, _Stats, 5.0) is None  # the first call starts the interval
        totals.total_prompt_tokens, totals.total_cached_tokens, totals.total_generation_tokens = 120, 20, 50
        assert stats.maybe_log(102.0, _Stats, 5.0) is None  # not due yet
        line = stats.maybe_log(105.0, _Stats, 5.0)
        assert line == ("Engine 000: Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                        "Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
        stats.maybe_log(110.0, _Stats, 5.0)  # idle after work: still INFO once, as in vLLM
        stats.maybe_log(115.0, _Stats, 5.0)  # idle twice: DEBUG
    levels = [r.levelno for r in caplog.records if r.name == "mlxd.engine"]
    assert levels == [logging.INFO, logging.INFO, logging.DEBUG]
