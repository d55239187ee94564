"""An engine killed again and again under load, restarted by a supervisor as launchd's KeepAlive would.

32 clients stream without pause while the engine is SIGKILLed five times.
Every request must either complete or end with a clear error (an error event
in its stream, or a 503 while no engine is up); none may hang. The gateway
is never restarted. After the last restart every client's next request
completes and the KV pool is whole again.
"""

from __future__ import annotations

import collections
import json
import threading
import time

import httpx

from tests.e2e.servers import Engine, Gateway, free_port

STREAMS = 32
KILLS = 5
BODY = {"messages": [{"role": "user", "content": "Count slowly from one to fifty."}], "max_tokens": 16,
        "temperature": 0, "ignore_eos": True, "stream": True}


def _one_request(http: httpx.Client, url: str) -> str:
    """'completed', 'stream error' or 'unavailable' (clear errors); AssertionError for anything else."""
    with http.stream("POST", url + "/v1/chat/completions", json=BODY) as r:
        if r.status_code == 503:
            body = json.loads(r.read())
            assert body["error"]["code"] == "engine_unavailable" and body["error"]["message"], body
            return "unavailable"
        assert r.status_code == 200, (r.status_code, r.read())
        finish, done = None, False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                assert "engine" in event["error"]["message"], event
                return "stream error"
            for choice in event["choices"]:
                finish = choice.get("finish_reason") or finish
        assert done and finish == "length", (done, finish)
        return "completed"


def _wait_serving(gateway, restarts: list, n: int, busy: bool = True, timeout: float = 120) -> None:
    """Until the engine of the ``n``-th restart serves the gateway (with 8+ requests running if ``busy``)."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"engine of restart {n} not serving after {timeout}s"
        if len(restarts) >= n:
            r = gateway.health(fresh=True)
            # No "engine" stats when the PONG was late (a busy step): ask again.
            running = (r.json().get("engine") or {}).get("num_running", 0) if r.status_code == 200 else -1
            if running >= (8 if busy else 0):
                return
        time.sleep(0.1)


def test_engine_killed_five_times_under_32_streams(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = Engine(endpoint, str(tmp_path / "engine.log")).start()
    gateway = Gateway(endpoint, str(tmp_path / "gateway.log")).start()
    stopping = threading.Event()
    restarts = []

    def supervise():
        # KeepAlive: whenever the engine is gone, start it again.
        while not stopping.is_set():
            if engine.proc.poll() is not None:
                engine.start()
                restarts.append(time.monotonic())
            time.sleep(0.1)

    outcomes: collections.Counter = collections.Counter()
    failures: list[str] = []
    lock = threading.Lock()
    load_done = threading.Event()

    def client():
        # The read timeout is what "no stream hangs" means: 60 s without a byte fails the request.
        with httpx.Client(timeout=httpx.Timeout(60.0, connect=10.0)) as http:
            while not load_done.is_set():
                try:
                    outcome = _one_request(http, gateway.url)
                except Exception as e:  # an assertion, or a read timeout: a hang
                    with lock:
                        failures.append(f"{type(e).__name__}: {e}")
                    return
                with lock:
                    outcomes[outcome] += 1
                if outcome != "completed":
                    time.sleep(1.0)  # as a client backs off; 503s must not starve the engine's load
            # After the last restart: the engine is up, so this one must complete.
            try:
                last = _one_request(http, gateway.url)
            except Exception as e:
                last = f"{type(e).__name__}: {e}"
            with lock:
                outcomes["final " + last] += 1

    supervisor = threading.Thread(target=supervise, daemon=True)
    try:
        gateway.wait_healthy()
        supervisor.start()
        clients = [threading.Thread(target=client, daemon=True) for _ in range(STREAMS)]
        for t in clients:
            t.start()
        for kill in range(KILLS):
            _wait_serving(gateway, restarts, kill)
            engine.proc.kill()
            # The gateway notices the kill (its streams end) before the next round looks at it.
            deadline = time.monotonic() + 10
            while gateway.health().status_code != 503:
                assert time.monotonic() < deadline, "the gateway did not notice the kill"
                time.sleep(0.05)
        _wait_serving(gateway, restarts, KILLS, busy=False)
        load_done.set()
        for t in clients:
            t.join(120)
            assert not t.is_alive(), "a client is stuck"
        assert not failures, failures
        print(f"\noutcomes: {dict(outcomes)}; restarts: {len(restarts)}")
        assert len(restarts) == KILLS
        assert outcomes["final completed"] == STREAMS, dict(outcomes)
        # Every kill hit streams in flight.
        assert outcomes["stream error"] >= KILLS, dict(outcomes)
        # Nothing leaked: once idle, every block of the last engine is free.
        deadline = time.monotonic() + 30
        while True:
            stats = gateway.health(fresh=True).json()["engine"]
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        assert gateway.proc.poll() is None
    finally:
        stopping.set()
        load_done.set()
        supervisor.join(5) if supervisor.is_alive() else None
        gateway.stop()
        engine.stop()
