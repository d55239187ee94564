"""The servers under test, each started fresh by the harness: mlxd, mlx_lm.server, llama-server.

Each launcher starts one process on a free loopback port, waits until it
answers, knows the process whose tree's memory is measured, and stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

CACHE = Path(os.environ.get("MLXD_BENCH_CACHE", Path.home() / ".cache" / "mlxd-bench"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (the engine is a child of `mlxd serve`)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for q in procs:
            try:
                total += q.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total
    # /proc without psutil (Linux): walk children via each process's stat line.
    parents: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    total, todo, page = 0, [pid], os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
        todo.extend(parents.get(p, []))
    return total


def served_model(url: str) -> str:
    """The first model a server lists at /v1/models."""
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


class PeakRSS:
    """Samples a process tree's RSS every `interval` seconds in a thread; `.peak` in bytes."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class Server:
    name = "server"
    ready_path = "/v1/models"

    def __init__(self, log_dir: Path, threads: int):
        self.port = free_port()
        self.log_dir, self.threads = Path(log_dir), threads
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def model_name(self) -> str:
        """The `model` field the server accepts."""
        return served_model(self.url)

    def start(self, timeout: float = 600.0) -> "Server":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_dir / f"{self.name}-{self.port}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout}s; see {self._log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # The whole session: `mlxd serve` has an engine child, and a peer may fork workers.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None:
            self._log.close()


class Mlxd(Server):
    name = "mlxd"
    ready_path = "/health"

    def __init__(self, log_dir, threads, model: str = "", extra: list[str] = ()):
        super().__init__(log_dir, threads)
        self.model, self.extra = model, list(extra)

    def command(self):
        # Its own engine socket: the default one is per user, and another `mlxd serve` may hold it.
        # A short temp path: Unix socket paths are limited to ~100 bytes. INFO: the log keeps start-up's
        # phases (how long loading and the warm-up took) and the engine's stats lines.
        sock = f"ipc://{tempfile.mkdtemp(prefix='mlxd-bench-')}/engine.sock"
        return [sys.executable, "-m", "mlxd", "serve", *([self.model] if self.model else []),
                "--port", str(self.port), "--engine-endpoint", sock, "--log-level", "INFO", *self.extra]


class MlxLm(Server):
    """mlx_lm.server on the same weights as float32 safetensors (see convert.py), with the fast BLAS."""
    name = "mlx_lm"
    ready_path = "/health"  # its /v1/models scans the Hugging Face cache and fails without one

    def __init__(self, log_dir, threads, model_dir: Path, extra: list[str] = ()):
        super().__init__(log_dir, threads)
        self.model_dir, self.extra = Path(model_dir), list(extra)

    def model_name(self) -> str:
        return str(self.model_dir)  # it serves a path as the model it was started with

    def command(self):
        return [sys.executable, "-m", "mlxd.bench.agent.mlx_lm_peer", "--model", str(self.model_dir),
                "--port", str(self.port), "--log-level", "WARNING", *self.extra]


def find_llama_server() -> str | None:
    """The binary built by bench/install_llama_server.sh, or one on PATH."""
    built = CACHE / "bin" / "llama-server"
    if built.is_file() and os.access(built, os.X_OK):
        return str(built)
    return shutil.which("llama-server")


class LlamaServer(Server):
    """llama.cpp's server on the GGUF itself: parallel slots, continuous batching, threads = cores."""
    name = "llama-server"
    ready_path = "/health"

    def __init__(self, log_dir, threads, gguf: str, parallel: int, ctx_per_slot: int, extra: list[str] = ()):
        super().__init__(log_dir, threads)
        self.gguf, self.parallel, self.ctx, self.extra = gguf, parallel, ctx_per_slot, list(extra)

    def command(self):
        binary = find_llama_server()
        if binary is None:
            raise FileNotFoundError("llama-server not built: run bench/install_llama_server.sh")
        # --ctx-size is shared by the slots: each gets ctx_size / parallel.
        return [binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(self.port),
                "--parallel", str(self.parallel), "--cont-batching", "--threads", str(self.threads),
                "--threads-batch", str(self.threads), "--ctx-size", str(self.ctx * self.parallel),
                "--jinja", *self.extra]
