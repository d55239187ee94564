"""Real mlxd processes on loopback for end-to-end tests: an engine, gateways, and their control."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# Small on purpose: the suite runs on 2 CPU cores. 16 streams of ~40 prompt +
# 16 generated tokens need ~64 blocks; the pool leaves room for prefix caching.
ENGINE_FLAGS = [
    "--num-kv-blocks", "160",
    "--max-num-seqs", "16",
    "--max-num-batched-tokens", "256",
    "--max-model-len", "512",
    "--gateway-timeout", "3",
    "--shutdown-timeout", "1",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The processes read keys from here, never from the user's own config dir: a key
# made with `mlxd keys add` on this machine would otherwise lock every test out.
_CONFIG_HOME = tempfile.mkdtemp(prefix="mlxd-e2e-config-")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["XDG_CONFIG_HOME"] = _CONFIG_HOME
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


class Engine:
    def __init__(self, endpoint: str, log_path: str, extra: list[str] = ()):
        self.endpoint = endpoint
        self.log_path = log_path
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Engine":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            # DEBUG: every abort is logged on both sides, to diagnose a failed test from its logs.
            [sys.executable, "-m", "mlxd", "engine", "--engine-endpoint", self.endpoint, "--log-level", "DEBUG",
             # Stop with the test run even if it dies without tearing down.
             "--parent-pid", str(os.getpid()), *ENGINE_FLAGS, *self.extra],
            stdout=self._log, stderr=subprocess.STDOUT, env=_env())
        return self

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class Gateway:
    def __init__(self, endpoint: str, log_path: str, extra: list[str] = ()):
        self.endpoint = endpoint
        self.port = free_port()
        self.log_path = log_path
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Gateway":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd", "gateway", "--engine-endpoint", self.endpoint,
             "--port", str(self.port), "--engine-timeout", "30", "--log-level", "DEBUG", *self.extra],
            stdout=self._log, stderr=subprocess.STDOUT, env=_env())
        return self

    def health(self, fresh: bool = False) -> httpx.Response:
        return httpx.get(self.url + "/health" + ("?fresh=1" if fresh else ""), timeout=5)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if self.health().status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"gateway {self.url} not healthy after {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def assert_error(r, anthropic: bool, status: int = 400) -> dict:
    """The error object of ``r``, a response of ``status`` whose body is the route's error shape
    (OpenAI's, or Anthropic's where ``anthropic``)."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    if anthropic:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    return body["error"]
