"""Two apps with their own keys on one engine: an app flooding it cannot starve the other.

App A keeps 64 requests in flight (four times the engine's running slots);
app B sends 4 streams. The scheduler preempts A's newest requests down to its
fair share, so B's streams start within a step or two: B's median time to first
token is a fraction of A's own, and close to B's time alone (the issue's goal
is within 2x; the ratio is printed, and asserted below 3x because on a shared
CPU every running row slows each step).
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx

from mlxd.shared.keys import add_key
from tests.e2e.servers import Gateway

FLOOD = 64
PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


def _ttft(url: str, key: str) -> float:
    """Seconds from sending a streamed request to its first content token."""
    t0 = time.perf_counter()
    body = {"messages": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - t0
                for _ in lines:  # read to the end, as a client would
                    pass
                return first
    raise AssertionError("no token streamed")


def _b_p50(url: str, key: str) -> float:
    """Median TTFT of B's 4 streams, sent together."""
    out = []
    threads = [threading.Thread(target=lambda: out.append(_ttft(url, key))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(out) == 4
    return statistics.median(out)


def test_a_flooding_app_does_not_starve_another(engine, tmp_path):
    keys_file = str(tmp_path / "keys.json")
    key_a, key_b = add_key(keys_file, "flood-a"), add_key(keys_file, "small-b")
    gw = Gateway(engine.endpoint, str(tmp_path / "gateway.log"), extra=["--keys-file", keys_file]).start()
    stop = threading.Event()
    errors = []
    floods: list[threading.Thread] = []

    def flood():
        body = {"messages": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=180, headers={"Authorization": f"Bearer {key_a}"}) as http:
            while not stop.is_set():
                try:
                    r = http.post(gw.url + "/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    return  # the gateway stopped at the end of the test
                if r.status_code != 200 and not stop.is_set():
                    errors.append(r.text)
                    return

    try:
        gw.wait_healthy()
        _b_p50(gw.url, key_b)  # warm-up: the first requests compile and fill caches
        alone = min(_b_p50(gw.url, key_b) for _ in range(2))
        floods += [threading.Thread(target=flood, daemon=True) for _ in range(FLOOD)]
        for t in floods:
            t.start()
        deadline = time.monotonic() + 60
        while True:  # A has filled the running slots and queues behind them
            stats = gw.health(fresh=True).json().get("engine") or {}
            if stats.get("num_running", 0) >= 16 and stats.get("num_waiting", 0) >= 16:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        # Four more of A's, sent with B's: what B would get if it merely queued in order.
        a_box = []
        a_side = threading.Thread(target=lambda: a_box.append(_b_p50(gw.url, key_a)))
        a_side.start()
        loaded = _b_p50(gw.url, key_b)
        a_side.join(300)
        a_loaded = a_box[0]
        print(f"\nTTFT p50: B alone {alone * 1000:.0f} ms; beside A's {FLOOD} in flight: B "
              f"{loaded * 1000:.0f} ms ({loaded / alone:.2f}x alone), A {a_loaded * 1000:.0f} ms")
        assert not errors, errors[:3]
        # B is admitted ahead of A's queue: a fraction of what A's own requests wait.
        assert loaded < 0.5 * a_loaded
        assert loaded < 3 * alone
    finally:
        stop.set()
        gw.stop()
        # The engine is the session's: leave it idle for the tests after this one.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(t.is_alive() for t in floods):
            time.sleep(0.2)
