"""A real `mlxd serve` (engine + gateway in one command) on loopback, with a small KV pool, for hostile-input tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.e2e.servers import _env, free_port

SERVE_FLAGS = ["--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-batched-tokens", "256",
               "--max-num-seqs", "8", "--shutdown-timeout", "1"]


class Serve:
    def __init__(self, tmp_path, extra: list[str] = ()):
        self.port = free_port()
        self.endpoint = f"ipc://{tmp_path}/engine.sock"
        self.log_path = tmp_path / "serve.log"
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> "Serve":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd", "serve", "--port", str(self.port), "--engine-endpoint",
             self.endpoint, *SERVE_FLAGS, *self.extra],
            stdout=self._log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlxd serve exited with {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"mlxd serve not healthy after {timeout}s: {self.log()[-3000:]}")
            time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        """The one engine process serve runs (its only child)."""
        pids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(pids) == 1, pids
        return int(pids[0])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
