"""Resident memory of `mlxd serve`'s engine process: after start-up, at the peak of a burst, after idle.

Starts `python -m mlxd serve` (the embedded default model, default flags but
the port and engine endpoint, so it runs beside other servers), reads the
engine child's RSS with ``ps`` when it is ready, sends a burst of concurrent
chat requests over HTTP while sampling the RSS every 0.2 s, then waits idle
for ``--idle`` seconds and reads it again. The code measured is whatever
``mlxd`` imports (run it with ``PYTHONPATH`` set to a checkout to measure that one).

    python -m bench.memory [--requests 16] [--prompt-words 600] [--max-tokens 64] [--idle 40] [--port 8431]

Each prompt opens with its own number (no two share a cached prefix) and
carries ``--prompt-words`` words of this project's README, so the burst needs
more KV than the pool holds at start.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TOPICS = ["the sea", "a city at night", "autumn", "a train journey", "mountains", "a market", "rain", "winter"]


def rss_bytes(pid: int) -> int:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return int(out) * 1024 if out else 0


def engine_pid(serve_pid: int) -> int | None:
    out = subprocess.run(["ps", "--ppid", str(serve_pid), "-o", "pid="], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    return pids[0] if pids else None


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> str:
    """The served model's id once a one-token completion answers (the engine is then up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlxd serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
                model = json.load(r)["data"][0]["id"]
            post(f"{base}/v1/chat/completions", {"model": model, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "hi"}]})
            return model
        except Exception:
            time.sleep(0.5)
    raise RuntimeError("mlxd serve did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--idle", type=float, default=40.0, help="seconds idle after the burst before reading RSS")
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--serve-args", default="", help="more `mlxd serve` flags, e.g. '--max-model-len 1024'")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after start-up before reading RSS")
    args = ap.parse_args()
    # A SIGTERM (``timeout``) still runs the ``finally`` below, which stops the server it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    base = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "mlxd", "serve", "--port", str(args.port),
               "--engine-endpoint", f"ipc://{tmp}/engine.sock", *args.serve_args.split()]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        try:
            model = wait_ready(base, proc, timeout=600)
            pid = engine_pid(proc.pid)
            time.sleep(args.settle)
            startup = rss_bytes(pid)
            print(f"engine RSS after start-up: {gb(startup)}", flush=True)

            peak, done = [startup], threading.Event()

            def sample():
                while not done.is_set():
                    peak.append(rss_bytes(pid))
                    time.sleep(0.2)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.monotonic()

            words = (Path(__file__).resolve().parent.parent / "README.md").read_text().split()
            filler = " ".join((words * (1 + args.prompt_words // len(words)))[: args.prompt_words])

            def one(i: int) -> int:
                text = f"Request {i}. Read this, then write a poem about {TOPICS[i % len(TOPICS)]}.\n\n{filler}"
                body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.7,
                        "messages": [{"role": "user", "content": text}]}
                return post(f"{base}/v1/chat/completions", body)["usage"]["completion_tokens"]

            with ThreadPoolExecutor(args.requests) as pool:
                tokens = sum(pool.map(one, range(args.requests)))
            burst_s = time.monotonic() - t0
            after_burst = rss_bytes(pid)
            print(f"burst: {args.requests} concurrent requests of ~{args.prompt_words} words, {tokens} tokens "
                  f"generated in {burst_s:.1f} s; peak RSS {gb(max(peak))}, right after {gb(after_burst)}", flush=True)
            time.sleep(args.idle)
            done.set()
            sampler.join()
            idle = rss_bytes(pid)
            print(f"engine RSS after {args.idle:.0f} s idle: {gb(idle)}", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for line in log:
        if "memory:" in line or "cut back" in line:
            print(f"log: {line.strip()}")


def gb(b: int) -> str:
    return f"{b / 1e9:.2f} GB"


if __name__ == "__main__":
    main()
