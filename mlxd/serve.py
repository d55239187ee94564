"""`mlxd serve`: the engine as a supervised child process, and a gateway in this one. Several
models (``mlxd serve A B``, ``--models-file``, ``--keep-alive``) are an engine each, supervised
together by mlxd/fleet.py.

The gateway stays up for the whole run. When the engine dies it answers 503
(its client notices at once) while the engine is restarted with a growing
delay, and reconnects by itself when the new engine is up. An engine that
dies before it ever served (a failed first load) ends serve with its exit
code; one that keeps dying soon after each start ends it after
``CRASH_LOOP_LIMIT`` tries, with one line saying so.

SIGTERM or SIGINT stops both at once, under one ``--shutdown-timeout``: the
gateway stops taking connections and tells the engine (``begin_stop``), and
both let what runs finish until the same deadline, then end it with an error
each client reads. The engine exits after the step it is in (a step is one MLX
call, which nothing interrupts); serve waits that long, up to
``STEP_GRACE_S``, so that the whole process tree exits within the timeout and
one step, before a service manager's own stop timeout has to kill it.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

from mlxd.flags import build_config, to_flags
from mlxd.ports import check_free
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.serve_config import DaemonConfig, GatewayConfig, ModelSetConfig

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


def hold_endpoint(endpoint: str):
    """A lock on an ipc endpoint's socket path for this process's lifetime (the open file), or None
    for other transports; InvalidRequestError, in one line, when another serve holds it."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):] + ".lock"
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise InvalidRequestError(f"another mlxd serve (pid {holder}) is using {endpoint}; stop it first, "
                                  "or give this one another --engine-endpoint", param="engine_endpoint") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


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


def main(args) -> int:
    from mlxd.shared.paths import check_ipc_endpoint, default_engine_endpoint, refuse_live_ipc

    engine_cfg = build_config(EngineConfig, args)
    daemon_cfg = build_config(DaemonConfig, args)
    if daemon_cfg.engine_endpoint is None:
        daemon_cfg.engine_endpoint = default_engine_endpoint()
    gateway_cfg = build_config(GatewayConfig, args)
    gateway_cfg.engine_endpoint = daemon_cfg.engine_endpoint
    gateway_cfg.curve_keys = daemon_cfg.curve_keys
    gateway_cfg.shutdown_timeout = daemon_cfg.shutdown_timeout

    # Before anything loads: a missing model file, another serve (or engine) on this endpoint, or on
    # either port, is one line, not a traceback after the load.
    check_free(gateway_cfg.host, gateway_cfg.port, "--port")
    models = getattr(args, "models", None) or []
    model_set = build_config(ModelSetConfig, args)
    if len(models) > 1 or model_set.models_file or model_set.keep_alive is not None:
        from mlxd.fleet import build_fleet

        supervisor, daemons = build_fleet(engine_cfg, daemon_cfg, models, model_set, args.log_level)
        gateway_cfg.model_endpoints = list(supervisor.endpoint_entries)
    else:
        check_model_path(engine_cfg.model)
        daemons = [daemon_cfg]
        supervisor = EngineSupervisor(engine_argv(engine_cfg, daemon_cfg, args.log_level))
    locks = []
    for d in daemons:
        check_free(d.metrics_host, d.metrics_port, "--metrics-port")
        check_ipc_endpoint(d.engine_endpoint)
        locks.append(hold_endpoint(d.engine_endpoint))
        refuse_live_ipc(d.engine_endpoint)

    def on_signal(_signum, _frame):
        supervisor.stop_requested = True

    # From now on a SIGTERM stops serve through its `finally` (the engine with it), never by
    # the signal's default action, which would leave the engine running on its own.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        supervisor.start()
        from mlxd.gateway.server import run_gateway

        return run_gateway(gateway_cfg, supervisor=supervisor)
    finally:
        supervisor.stop(daemon_cfg.shutdown_timeout)
        for lock in locks:
            if lock is not None:
                lock.close()
