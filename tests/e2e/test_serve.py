"""`mlxd serve`: one command starts the engine and the gateway; Ctrl-C stops both; a dead engine is
restarted while the gateway answers 503; SIGTERM drains, then ends what is left with errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai

from tests.e2e.serve_harness import Serve, gone
from tests.e2e.servers import free_port
from tests.tiny_models import make_tiny_model


def test_serve_runs_engine_and_gateway_and_ctrl_c_stops_both(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", "--port", str(port),
         "--engine-endpoint", f"ipc://{tmp_path}/engine.sock", "--num-kv-blocks", "32",
         "--max-model-len", "256", "--max-num-batched-tokens", "128", "--shutdown-timeout", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True)  # its own process group, as a terminal's Ctrl-C would see it
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mlxd serve did not become healthy"
            time.sleep(0.25)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        assert "SmolLM2" in model  # the embedded default
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4)
        assert r.choices[0].message.content is not None
        engine_pids = subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True,
                                     text=True).stdout.split()
        assert len(engine_pids) == 1

        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
        try:
            serve.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGUSR1)  # stacks into the log, to see what hangs
            time.sleep(1)
            raise AssertionError((tmp_path / "serve.log").read_text()[-6000:]) from None
        assert serve.returncode == 0
        # A deliberate stop is no loss of the engine; the line that says the URL serves came once it was up.
        said = (tmp_path / "serve.log").read_text()
        assert "engine lost" not in said and "mlxd gateway: serving SmolLM2" in said, said[-4000:]
        time.sleep(0.5)
        assert not os.path.exists(f"/proc/{engine_pids[0]}") or \
            open(f"/proc/{engine_pids[0]}/stat").read().split()[2] == "Z"
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        log.close()


# ---- supervision, shutdown and start-up checks (real `mlxd serve` processes) -------------------

STREAMS = 16
LONG = {"messages": [{"role": "user", "content": "Write a long poem about autumn."}],
        "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


def _stream(url: str, record: dict, started: threading.Event, body: dict = LONG) -> None:
    """One SSE chat stream; ``record`` gets chunks, the error event, [DONE], and when it ended."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as r:
            record["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    record["done"] = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    record["error"] = event["error"]
                else:
                    record["chunks"] = record.get("chunks", 0) + 1
                    if record["chunks"] >= 2:
                        started.set()
                    for choice in event["choices"]:
                        record["finish"] = choice.get("finish_reason") or record.get("finish")
    except httpx.HTTPError as e:
        record["transport_error"] = repr(e)
    finally:
        record["ended"] = time.monotonic()
        started.set()


def _start_streams(url: str, n: int, body: dict = LONG):
    records, threads = [], []
    for _ in range(n):
        record, started = {}, threading.Event()
        t = threading.Thread(target=_stream, args=(url, record, started, body), daemon=True)
        t.start()
        records.append((record, started))
        threads.append(t)
    for record, started in records:
        assert started.wait(180) and "error" not in record, record
    return threads, [r for r, _ in records]


def _wait_engine_took(url: str, n: int, done: list) -> None:
    """Until the engine has taken ``n`` requests (running or waiting now, or in ``done``): a fixed
    sleep let a loaded machine signal serve before a request had reached the engine, which then
    refuses it as shutting down."""
    deadline = time.monotonic() + 60
    while True:
        stats = httpx.get(url + "/health", params={"fresh": 1}, timeout=10).json()["engine"]
        took = stats["num_running"] + stats["num_waiting"] + len(done)
        if took >= n:
            return
        assert time.monotonic() < deadline, f"the engine took {took} of {n} requests"
        time.sleep(0.05)


def test_serve_restarts_a_killed_engine_while_the_gateway_answers_503(tmp_path):
    serve = Serve(tmp_path, "--max-num-seqs", "16").start()
    try:
        serve.wait_healthy()
        engine = serve.wait_engine()
        threads, records = _start_streams(serve.url, STREAMS)
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        for t in threads:
            t.join(60)
        latencies = []
        for record in records:
            assert record.get("ended"), "a stream still open after the engine died"
            assert record.get("error") and "engine" in record["error"]["message"], record
            assert record.get("done"), record  # the stream ends properly: error event, then [DONE]
            latencies.append(record["ended"] - killed)
        print(f"{STREAMS} streams ended with an error event {min(latencies):.3f}-{max(latencies):.3f}s "
              "after the SIGKILL")
        r = serve.health()
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        # Back by itself: a new engine, the same gateway (serve) process.
        serve.wait_healthy()
        assert serve.proc.poll() is None
        new_engine = serve.wait_engine(not_pid=engine)
        assert new_engine != engine
        r = httpx.post(serve.url + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        assert "restarting the engine" in serve.log()
    finally:
        serve.stop()


def test_sigterm_drains_then_ends_open_requests_with_errors(tmp_path):
    serve = Serve(tmp_path, "--shutdown-timeout", "4", "--max-num-seqs", "8").start()
    try:
        serve.wait_healthy()
        engine = serve.wait_engine()
        # Long ones: a stream and a plain request that cannot finish within the timeout.
        threads, records = _start_streams(serve.url, 2)
        plain_long = {}

        def post_long():
            r = httpx.post(serve.url + "/v1/chat/completions", json=LONG, timeout=120)
            plain_long.update(status=r.status_code, type=r.headers.get("content-type"), body=r.json())

        t_long = threading.Thread(target=post_long, daemon=True)
        t_long.start()
        short = []

        def post_short():
            r = httpx.post(serve.url + "/v1/chat/completions", timeout=120,
                           json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
            short.append((r.status_code, r.json()))

        t_short = [threading.Thread(target=post_short, daemon=True) for _ in range(2)]
        for t in t_short:
            t.start()
        _wait_engine_took(serve.url, 5, short)  # the requests reach the engine before the signal
        os.kill(serve.proc.pid, signal.SIGTERM)
        for t in [*threads, t_long, *t_short]:
            t.join(60)
        # What fits in the timeout completes...
        assert [s for s, _ in short] == [200, 200], short
        assert all(body["choices"][0]["finish_reason"] == "length" for _, body in short)
        # ...the rest ends with a clear error: a JSON body, or an SSE error event and [DONE].
        assert plain_long["status"] == 503 and plain_long["type"].startswith("application/json"), plain_long
        assert "shutting down" in plain_long["body"]["error"]["message"]
        for record in records:
            assert record.get("error") and "shutting down" in record["error"]["message"], record
            assert record.get("done"), record
        assert serve.wait(60) == 0
        assert gone(engine)
    finally:
        serve.stop()


def test_sigterm_during_the_model_load_stops_serve_and_its_engine_at_once(tmp_path):
    serve = Serve(tmp_path).start()
    try:
        engine = serve.wait_engine()
        assert not (tmp_path / "engine.sock").exists()  # still loading
        os.kill(serve.proc.pid, signal.SIGTERM)
        serve.wait(30)
        assert gone(engine), "the engine kept loading after serve was stopped"
    finally:
        serve.stop()


def test_a_failed_first_load_ends_serve_with_one_line(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(range(64)))
    serve = Serve(tmp_path, model=str(tmp_path / "broken.gguf")).start()
    try:
        assert serve.wait(120) != 0
        log = serve.log()
        assert "before it served" in log and "restarting" not in log
        assert "gateway on" not in log and "serving" not in log, log  # nothing was ever served
    finally:
        serve.stop()


def test_a_second_serve_on_the_same_runtime_dir_fails_in_one_line_before_loading(tmp_path):
    model = str(make_tiny_model(tmp_path / "tiny", "llama", seed=3))
    first = Serve(tmp_path, model=model).start()
    try:
        first.wait_healthy()
        second = Serve(tmp_path, model=model, endpoint=first.endpoint).start()
        try:
            assert second.wait(30) == 2
            log = second.log()
            assert "another mlxd serve" in log and "Traceback" not in log and "loading" not in log, log
            assert len(log.strip().splitlines()) == 1, log
        finally:
            second.stop()
        assert first.health().status_code == 200
    finally:
        first.stop()


def test_an_engine_that_keeps_dying_ends_serve_with_one_clear_message(tmp_path):
    model = str(make_tiny_model(tmp_path / "tiny", "llama", seed=4))
    serve = Serve(tmp_path, model=model).start()
    try:
        serve.wait_healthy()
        killed = []
        while serve.proc.poll() is None:
            pid = next((p for p in serve.engine_pids() if p not in killed), None)
            if pid is not None and (tmp_path / "engine.sock").exists():
                try:
                    if serve.health().status_code == 200:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                except httpx.HTTPError:
                    pass
            assert len(killed) <= 10, serve.log()[-4000:]
            time.sleep(0.1)
        assert serve.wait(10) == 1
        assert len(killed) == 5  # mlxd.supervisor.CRASH_LOOP_LIMIT
        assert serve.log().count("giving up") == 1
    finally:
        serve.stop()
