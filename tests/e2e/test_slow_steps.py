"""`mlxd serve` under slow steps, as a loaded machine has them: here a large prefill budget makes one
step of a long prompt take seconds on the CPU. Clients that leave are dropped within the step they
left in, and a request whose client left before the engine took it in is never taken in; the engine's
gauges say what it holds during a step; SIGTERM ends the whole process tree within one shutdown
timeout and one step, each client with an error it can read.

Prompts are random words drawn for each test (the seed is printed), so that none finds another's
blocks in the prefix cache.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.serve_harness import Serve
from tests.e2e.servers import free_port

# One step prefills up to 8192 tokens: a prompt of BIG words is one step of seconds on this CPU.
SLOW = ["--max-model-len", "4096", "--max-num-batched-tokens", "8192", "--max-num-seqs", "16",
        "--num-kv-blocks", "512"]
BIG, SMALL = 1200, 300
WORDS = ("apple river stone cloud green paper quiet table window music orange silver garden yellow "
         "engine mountain letter summer winter basket candle forest harbor island lemon market "
         "needle ocean pencil rabbit saddle tunnel valley wagon").split()
# Seconds allowed past the moment the engine could act (a step's end, a deadline).
SLACK = 3.0
# Series of the engine's /metrics (the default prefix).
FINISHED = "mlxd:request_success_total"
STEPS = "mlxd:step_duration_seconds_count"
STEP_SECONDS = "mlxd:step_duration_seconds_sum"
RUNNING = "mlxd:num_requests_running"
WAITING = "mlxd:num_requests_waiting"
BLOCKS_FREE = "mlxd:kv_cache_blocks_free"
BLOCKS = "mlxd:kv_cache_blocks_total"


def fresh_rng() -> random.Random:
    seed = random.SystemRandom().randrange(2**32)
    print(f"prompt seed {seed}")
    return random.Random(seed)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Post:
    """A POST on a connection of its own, sent but for its body's last ``hold_back`` bytes (``finish``
    sends them); its answer is left unread until the test reads it (``answer``) or leaves."""

    def __init__(self, port: int, path: str, body: dict, hold_back: int = 0):
        data = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", port))
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        self.sock.sendall(head + data[:len(data) - hold_back])
        self._rest = data[len(data) - hold_back:]

    def finish(self) -> None:
        self.sock.sendall(self._rest)

    def leave(self) -> None:
        """The client hangs up, as one whose timeout fired would."""
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def answer(self) -> tuple[int, str]:
        """(status, body), read until the server closes the connection."""
        self.sock.settimeout(60)
        raw = b""
        while chunk := self.sock.recv(65536):
            raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body.decode(errors="replace")


def metrics(url: str, **labels: str) -> dict[str, float]:
    """Each sample of a /metrics page (those with ``labels``) by name, summed over its other labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            if all(s.labels.get(k) == v for k, v in labels.items()):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def answered(url: str, handler: str, status: str) -> float:
    """How many requests to ``handler`` the gateway answered with ``status`` (its HTTP metrics)."""
    return metrics(url, handler=handler, status=status).get("http_requests_total", 0.0)


def wait_idle(serve: Serve, within: float) -> float:
    """Seconds until the engine holds no request and every KV block is free (its own answer)."""
    start = time.monotonic()
    while True:
        engine = httpx.get(serve.url + "/health?fresh=1", timeout=10).json()["engine"]
        if engine["num_running"] == engine["num_waiting"] == 0 and \
                engine["num_free_blocks"] == engine["num_total_blocks"]:
            return time.monotonic() - start
        assert time.monotonic() - start < within, f"the engine still holds {engine}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    port = free_port()
    serve = Serve(tmp_path_factory.mktemp("slow"), *SLOW, "--metrics-port", str(port),
                  "--trust-request-chat-template").start()
    try:
        serve.wait_healthy()
        yield serve, f"http://127.0.0.1:{port}/metrics"
    finally:
        serve.stop()


def test_a_burst_whose_clients_leave_during_a_slow_step_is_dropped_when_it_ends_and_never_taken_in(slow):
    serve, engine_metrics = slow
    rng = fresh_rng()
    before = metrics(engine_metrics)
    first = Post(serve.port, "/v1/completions", {"prompt": words(rng, BIG), "max_tokens": 64, "stream": True})
    time.sleep(0.5)  # its prefill, one long step, is running
    burst = [Post(serve.port, "/v1/completions", {"prompt": words(rng, SMALL), "max_tokens": 64, "stream": True})
             for _ in range(6)]
    time.sleep(1.0)  # each is tokenized and sent while the step runs
    assert metrics(engine_metrics)[STEPS] == before[STEPS], "the step ended before the clients left"
    for post in (first, *burst):
        post.leave()
    idle = wait_idle(serve, within=600)
    after = metrics(engine_metrics)
    step = after[STEP_SECONDS] - before[STEP_SECONDS]
    print(f"idle {idle:.1f}s after the clients left; the step they left in took {step:.1f}s")
    assert idle <= step + SLACK
    # Only the request the engine had taken in before its client left ever ran (and was aborted).
    assert after[FINISHED] - before[FINISHED] == 1


# A chat template of the request that takes half a second of a worker thread to render (a loaded
# gateway's wait for its threads): 200,000 empty loop turns, then ChatML.
SLOW_TEMPLATE = ("{% for i in range(40000) %}{% for j in range(5) %}{% endfor %}{% endfor %}"
                 "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "<|im_start|>assistant\n")


def test_a_client_that_leaves_while_its_prompt_waits_for_the_gateways_threads_is_never_sent(slow):
    serve, engine_metrics = slow
    rng = fresh_rng()
    chat, gateway_metrics = "/v1/chat/completions", serve.url + "/metrics"
    before = metrics(engine_metrics)
    refused_before = answered(gateway_metrics, chat, "499")

    def body(stream: bool) -> dict:
        return {"messages": [{"role": "user", "content": words(rng, SMALL)}], "chat_template": SLOW_TEMPLATE,
                "max_tokens": 4, "stream": stream}

    # More renders than the gateway has threads: some wait for one, the others are being rendered.
    gone = [Post(serve.port, chat, body(stream=True)) for _ in range(12)]
    time.sleep(0.5)
    for post in gone:
        post.leave()
    # A client that stays is answered once its own render, queued after theirs, is done.
    assert httpx.post(serve.url + chat, json=body(stream=False), timeout=300).status_code == 200
    wait_idle(serve, within=60)
    # The engine ran the one that stayed and nothing of those that left; the gateway began no answer
    # for them (nginx's 499, client closed request).
    assert metrics(engine_metrics)[FINISHED] - before[FINISHED] == 1
    assert answered(gateway_metrics, chat, "499") - refused_before == len(gone)


def test_the_gauges_say_what_the_engine_holds_during_a_slow_step(slow):
    serve, engine_metrics = slow
    rng = fresh_rng()
    before = metrics(engine_metrics)
    first = Post(serve.port, "/v1/completions", {"prompt": words(rng, BIG), "max_tokens": 64, "stream": True})
    time.sleep(1.0)  # its prefill, one long step, is running
    arrived = [Post(serve.port, "/v1/completions", {"prompt": words(rng, SMALL), "max_tokens": 64,
                                                     "stream": True}) for _ in range(4)]
    try:
        while True:
            now = metrics(engine_metrics)
            assert now[STEPS] == before[STEPS], \
                f"the step ended before the gauges showed it: {[now[k] for k in (RUNNING, WAITING, BLOCKS_FREE)]}"
            # The step's request runs and holds blocks; the four that came during it wait.
            if now[RUNNING] == 1 and now[WAITING] == 4 and now[BLOCKS_FREE] < now[BLOCKS]:
                break
            time.sleep(0.2)
    finally:
        for post in (first, *arrived):
            post.leave()
    wait_idle(serve, within=600)


def test_sigterm_under_slow_steps_ends_serve_within_one_timeout_and_one_step(tmp_path):
    timeout = 3.0
    port = free_port()
    serve = Serve(tmp_path, *SLOW, "--shutdown-timeout", str(timeout), "--metrics-port", str(port)).start()
    engine_metrics = f"http://127.0.0.1:{port}/metrics"
    try:
        serve.wait_healthy()
        rng = fresh_rng()
        before = metrics(engine_metrics)
        first = _Stream(serve.url, words(rng, BIG))
        assert first.started.wait(300), first.record
        # The step this test allows past the deadline: a prefill of the same length as the one in flight then.
        step = metrics(engine_metrics)[STEP_SECONDS] - before[STEP_SECONDS]
        second = _Stream(serve.url, words(rng, BIG))
        # A client still sending its body when the signal comes: it must not reach the engine after that.
        late = Post(serve.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": words(rng, BIG)}],
                                                         "max_tokens": 64, "stream": True}, hold_back=10)
        time.sleep(1.0)  # the second prefill, one long step, is running
        signalled = time.monotonic()
        os.kill(serve.proc.pid, signal.SIGTERM)
        time.sleep(timeout + 1.0)
        late.finish()
        status, body = late.answer()
        assert serve.wait(120) == 0
        took = time.monotonic() - signalled
        print(f"serve exited {took:.1f}s after SIGTERM (timeout {timeout:g}s, a step {step:.1f}s)")
        for stream in (first, second):
            stream.thread.join(30)
            assert "shutting down" in stream.record.get("error", ""), stream.record
            assert stream.record.get("done"), stream.record  # the error event, then [DONE]
        assert status == 503 and "shutting down" in body, (status, body)
        assert took <= timeout + step + SLACK
        log = serve.log()
        assert "engine lost" not in log and "killing it" not in log, log[-4000:]
    finally:
        serve.stop()


class _Stream:
    """A streamed completion read in a thread of its own; ``started`` is set at its first token."""

    def __init__(self, url: str, prompt: str):
        self.record: dict = {}
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, prompt), daemon=True)
        self.thread.start()

    def _read(self, url: str, prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        self.record["done"] = True
                    elif line.startswith("data: "):
                        event = json.loads(data)
                        if "error" in event:
                            self.record["error"] = event["error"]["message"]
                        else:
                            self.started.set()
        except httpx.HTTPError as e:
            self.record["transport_error"] = repr(e)
        finally:
            self.started.set()
