"""One `mlxd engine` child process, supervised: started with a pipe it writes once it serves,
restarted with a growing delay when it dies, and stopped under the shutdown timeout. `mlxd serve`
runs one (mlxd/serve.py); a fleet runs one per model (mlxd/fleet.py).

The gateway stays up meanwhile. When the engine dies it answers 503 (its
client notices at once) while the engine is restarted, and reconnects by
itself when the new engine is up. An engine that dies before it ever served
(a failed first load) ends serve with its exit code; one that keeps dying
soon after each start ends it after ``CRASH_LOOP_LIMIT`` tries, with one line
saying so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from mlxd.flags import to_flags
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.serve_config import DaemonConfig

# Restart delays grow from the first to the last, doubling.
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 8.0
# An engine that served this long before dying was not crash-looping: the count starts again.
STABLE_AFTER_S = 60.0
CRASH_LOOP_LIMIT = 5
# How long past the shutdown deadline serve waits for the engine's step in flight before it kills
# the engine (its requests have all been ended by then: nothing is lost but the step).
STEP_GRACE_S = 10.0


class EngineSupervisor:
    """Runs ``argv`` (an `mlxd engine` command line) and restarts it; ``poll()`` from the gateway's loop."""

    # One engine always runs: nothing is started on demand (mlxd/fleet.py does that for a set).
    on_demand = False

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.ever_ready = False
        self._ready_r: int | None = None
        self._ready = False
        self._started_at = 0.0
        self._crashes = 0
        self._restart_at: float | None = None
        # Set by serve's SIGTERM/SIGINT handler until the gateway's own takes over.
        self.stop_requested = False
        # When the engine was told to stop (monotonic), None before.
        self._stopping_since: float | None = None

    def start(self) -> None:
        r, w = os.pipe()
        try:
            # A session of its own: a terminal's Ctrl-C reaches serve alone, which stops the gateway
            # and tells the engine in the same moment (``begin_stop``), so that one timeout holds for both.
            self.process = subprocess.Popen([*self.argv, "--ready-fd", str(w)], pass_fds=(w,),
                                            start_new_session=True)
        finally:
            os.close(w)
        os.set_blocking(r, False)
        self._ready_r, self._ready, self._started_at = r, False, time.monotonic()

    def _read_ready(self) -> None:
        if self._ready or self._ready_r is None:
            return
        try:
            if os.read(self._ready_r, 1):
                self._ready = self.ever_ready = True
        except BlockingIOError:
            pass

    def poll(self, idle: dict | None = None) -> int | None:
        """Check on the engine: None while serve goes on, else serve's exit code (and why, printed).
        ``idle``: the gateway's idle seconds per model, which only a fleet's keep-alive reads."""
        if self.stop_requested:
            return 0
        now = time.monotonic()
        if self._restart_at is not None:
            if now >= self._restart_at:
                self._restart_at = None
                self.restarts += 1
                print(f"mlxd: restarting the engine (restart {self.restarts})", file=sys.stderr, flush=True)
                self.start()
            return None
        self._read_ready()
        rc = self.process.poll()
        if rc is None:
            return None
        self._read_ready()  # it may have served and died between the two looks
        os.close(self._ready_r)
        self._ready_r = None
        if not self.ever_ready:
            print(f"mlxd: the engine exited with code {rc} before it served; stopping", file=sys.stderr,
                  flush=True)
            return rc or 1
        self._crashes = 1 if now - self._started_at >= STABLE_AFTER_S else self._crashes + 1
        if self._crashes >= CRASH_LOOP_LIMIT:
            print(f"mlxd: the engine died {self._crashes} times in a row, each within {STABLE_AFTER_S:.0f}s "
                  f"of its start (last exit code {rc}); giving up: see its log above", file=sys.stderr,
                  flush=True)
            return 1
        delay = min(MAX_RESTART_DELAY_S, FIRST_RESTART_DELAY_S * 2 ** (self._crashes - 1))
        print(f"mlxd: the engine exited with code {rc}; restarting it in {delay:.1f}s (the gateway answers "
              f"503 meanwhile)", file=sys.stderr, flush=True)
        self._restart_at = now + delay
        return None

    def begin_stop(self) -> None:
        """SIGTERM the engine, once: it stops taking requests and gives those it runs its shutdown
        timeout, counted from now, the gateway's moment."""
        if self._stopping_since is not None:
            return
        self._stopping_since = time.monotonic()
        p = self.process
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        """Wait for the engine to exit (``begin_stop`` if not yet) until ``timeout`` seconds after it
        was told, plus STEP_GRACE_S for its step in flight; then SIGKILL it."""
        self.begin_stop()
        p = self.process
        if p is not None and p.poll() is None:
            left = self._stopping_since + timeout + STEP_GRACE_S - time.monotonic()
            try:
                p.wait(timeout=max(left, 0.0))
            except subprocess.TimeoutExpired:
                print(f"mlxd: the engine was still in a step {STEP_GRACE_S:g}s past the shutdown timeout; "
                      "killing it", file=sys.stderr, flush=True)
                p.kill()
                p.wait()
        if self._ready_r is not None:
            os.close(self._ready_r)
            self._ready_r = None


def check_model_path(model: str) -> None:
    """InvalidRequestError, in one line, for a model named by a path that does not exist (the
    loader's reading: one that starts like a path or names a .gguf file; anything else may be a
    Hugging Face repo id), found before an engine starts and fails after its imports."""
    if model.startswith((".", "/", "~")) or model.lower().endswith(".gguf"):
        if not os.path.exists(os.path.expanduser(model)):
            raise InvalidRequestError(f"{model}: no such file or directory", param="model")


def engine_argv(engine_cfg: EngineConfig, daemon_cfg: DaemonConfig, log_level: str) -> list[str]:
    """The `mlxd engine` command line of serve's child."""
    return [sys.executable, "-m", "mlxd", "engine", "--log-level", log_level,
            *to_flags(engine_cfg), *to_flags(daemon_cfg), "--parent-pid", str(os.getpid())]
