"""The engine process (`mlxd engine`): set up the process, load the model, then serve gateways until stopped."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import MlxdError
from mlxd.shared.serve_config import DaemonConfig

log = logging.getLogger("mlxd.engine")


def run_engine(config: EngineConfig, daemon: DaemonConfig, parent_pid: int | None = None,
               ready_fd: int | None = None) -> int:
    """Build the Engine and run the daemon loop; returns the exit code.

    ``parent_pid``: stop when that process (`mlxd serve`) is gone, during the
    load too. ``ready_fd``: a pipe to write one byte to once gateways are served.
    """
    loading = threading.Event()
    if parent_pid is not None:
        # The daemon loop watches the parent once it runs; imports and the load take a while
        # and must not outlive it.
        threading.Thread(target=_exit_with_parent, args=(parent_pid, loading), daemon=True,
                         name="parent-watch").start()
    from mlxd.engined.device import load_fast_blas, slow_blas_warning

    # Before anything imports mlx.core (engined/device.py says why).
    load_fast_blas()
    _check_mlx()
    if (warning := slow_blas_warning()) is not None:
        log.warning("%s", warning)
    if config.num_ranks > 1:
        from mlxd.engined.parallel import pipeline

        groups = pipeline.join(config)
        if groups.link.rank() > 0:  # a worker: no socket, no gateways; it mirrors rank 0 until rank 0 is gone
            return pipeline.serve_worker(config, groups, loading)
    from mlxd.engined.daemon import Daemon
    from mlxd.engined.encoders.engine import EncoderEngine, encoder_dir
    from mlxd.engined.engine import Engine
    from mlxd.engined.speech.engine import SpeechEngine, speech_dir
    from mlxd.shared.curve import check_endpoint
    from mlxd.shared.paths import check_ipc_endpoint, default_engine_endpoint, refuse_live_ipc

    endpoint = daemon.engine_endpoint or default_engine_endpoint()
    # Refused before the model loads, which can take minutes.
    check_ipc_endpoint(endpoint)
    check_endpoint(endpoint, daemon.curve_keys)
    refuse_live_ipc(endpoint)
    log.info("loading %s", config.model or "the embedded SmolLM2")
    try:
        started = time.monotonic()
        with _progress("loading the model and warming up"):
            encoder, speech = encoder_dir(config.model), speech_dir(config.model)
            engine = (EncoderEngine(config, encoder) if encoder is not None
                      else SpeechEngine(config, speech) if speech is not None else Engine(config))
    except KeyboardInterrupt:
        return 130
    finally:
        loading.set()  # the daemon loop watches the parent from here on
    d = Daemon(engine, endpoint, gateway_timeout=daemon.gateway_timeout,
               shutdown_timeout=daemon.shutdown_timeout, parent_pid=parent_pid,
               curve_keys=daemon.curve_keys, log_stats=not daemon.disable_log_stats)
    d.install_signal_handlers()
    if daemon.metrics_port is not None:
        server, _ = engine.metrics.serve(daemon.metrics_port, daemon.metrics_host, held=d.held)
        print(f"mlxd engine metrics on http://{daemon.metrics_host}:{server.server_port}/metrics",
              file=sys.stderr, flush=True)
    info = d.info
    print(f"mlxd engine ready: {info.served_model_name} on {d.endpoint} "
          f"(max_model_len {info.max_model_len}, {info.num_kv_blocks} KV blocks of {info.block_size}; "
          f"started in {time.monotonic() - started:.1f} s)",
          file=sys.stderr, flush=True)
    if ready_fd is not None:
        os.write(ready_fd, b"R")
        os.close(ready_fd)
    return d.run()


def _check_mlx() -> None:
    """MLX importable, or one line saying what to install (Linux needs MLX's CPU or CUDA build)."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        if sys.platform == "darwin":
            raise MlxdError(f"MLX does not load ({e}); reinstall it: pip install -U mlx") from e
        raise MlxdError(f"MLX has no backend here ({e}): install its CPU build with "
                        "pip install 'mlxd[cpu]' (or mlx[cuda] for NVIDIA GPUs)") from e


def _exit_with_parent(parent_pid: int, loaded: threading.Event) -> None:
    while not loaded.wait(0.2):
        if os.getppid() != parent_pid:
            print("mlxd engine: its parent process exited during the load; stopping", file=sys.stderr,
                  flush=True)
            os._exit(1)


# Seconds between "still loading" lines when stderr is a log file, not a terminal.
_LOAD_LOG_EVERY_S = 15.0


@contextlib.contextmanager
def _progress(what: str):
    """An elapsed-time bar on a terminal while ``what`` runs (the load reports no fractions); in a
    log file, a line every ``_LOAD_LOG_EVERY_S`` seconds and one when it is done."""
    if not sys.stderr.isatty():
        start = time.monotonic()
        with _every(_LOAD_LOG_EVERY_S, lambda: log.info("%s: %.0fs so far", what, time.monotonic() - start)):
            yield
        log.info("%s took %.1fs", what, time.monotonic() - start)
        return
    from tqdm import tqdm

    bar = tqdm(desc=what, bar_format="{desc}: {elapsed}", file=sys.stderr)
    try:
        with _every(0.2, bar.refresh):
            yield
    finally:
        bar.close()


@contextlib.contextmanager
def _every(period: float, fn):
    """Call ``fn`` every ``period`` seconds on a daemon thread while the block runs."""
    done = threading.Event()

    def loop():
        while not done.wait(period):
            fn()

    t = threading.Thread(target=loop, daemon=True, name="load-progress")
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
