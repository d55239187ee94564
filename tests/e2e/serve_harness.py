"""`mlxd serve` as a test runs it: its own process group, its log in a file, its engine child found."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.e2e.servers import _env, free_port

# A small pool and a short context, for tests that only need the server to answer (and stay up).
SMALL = ("--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-batched-tokens", "256",
         "--max-num-seqs", "8", "--shutdown-timeout", "1")


class Serve:
    def __init__(self, tmp_path, *flags: str, model: str | None = None, endpoint: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint = endpoint or f"ipc://{tmp_path}/engine.sock"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        self.argv = [sys.executable, "-m", "mlxd", "serve", *([model] if model else []), "--port", str(self.port),
                     "--engine-endpoint", self.endpoint, "--max-model-len", "2048",
                     # A pool given in blocks: the engine starts without the warm-up step that measures
                     # activations (a 2,048-token prefill, seconds on a CPU, at every start and restart).
                     "--num-kv-blocks", "160", *flags]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Serve":
        self._log = open(self.log_path, "wb")
        # Its own process group, as a terminal's job would be.
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=_env(),
                                     start_new_session=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=10)

    def wait_healthy(self, timeout: float = 180.0) -> "Serve":
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log()[-4000:]
            try:
                if self.health().status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mlxd serve did not become healthy:\n" + self.log()[-4000:]
            time.sleep(0.2)

    def engine_pid(self) -> int:
        """The one engine process serve runs (its only child)."""
        pids = self.engine_pids()
        assert len(pids) == 1, pids
        return pids[0]

    def engine_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def wait_engine(self, timeout: float = 60.0, not_pid: int | None = None) -> int:
        deadline = time.monotonic() + timeout
        while True:
            pids = [p for p in self.engine_pids() if p != not_pid]
            if pids:
                return pids[0]
            assert time.monotonic() < deadline, "no engine child:\n" + self.log()[-4000:]
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGUSR1)  # stacks into the log, to see what hangs
            time.sleep(1)
            raise AssertionError(self.log()[-6000:]) from None

    def stop(self, graceful: bool = False) -> None:
        """Killed outright, or ``graceful``: SIGINT, as Ctrl-C in its terminal (the engine then writes what
        it still owes, such as the KV disk tier's queue), and SIGKILL only if it is not gone in 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            if graceful:
                os.killpg(self.proc.pid, signal.SIGINT)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None:
            self._log.close()


def gone(pid: int) -> bool:
    """The process exited (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
