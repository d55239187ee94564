"""`python -m engined` / `mlxd engine`: load the model, then serve gateways until stopped."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

from engined.daemon import Daemon
from shared.config import EngineConfig
from shared.serve_config import DaemonConfig

log = logging.getLogger("mlxd.engine")


def run_engine(config: EngineConfig, daemon: DaemonConfig, parent_pid: int | None = None) -> int:
    """Build the Engine and run the daemon loop; returns the exit code."""
    from engined.engine import Engine
    from shared.curve import check_endpoint
    from shared.paths import check_ipc_endpoint, default_engine_endpoint

    endpoint = daemon.engine_endpoint or default_engine_endpoint()
    # Refused before the model loads, which can take minutes.
    check_ipc_endpoint(endpoint)
    check_endpoint(endpoint, daemon.curve_keys)
    log.info("loading %s", config.model or "the embedded SmolLM2")
    try:
        with _progress("loading the model and warming up"):
            engine = Engine(config)
    except KeyboardInterrupt:
        return 130
    d = Daemon(engine, endpoint, gateway_timeout=daemon.gateway_timeout,
               shutdown_timeout=daemon.shutdown_timeout, parent_pid=parent_pid,
               curve_keys=daemon.curve_keys)
    d.install_signal_handlers()
    if daemon.metrics_port is not None:
        server, _ = engine.metrics.serve(daemon.metrics_port, daemon.metrics_host)
        print(f"mlxd engine metrics on http://{daemon.metrics_host}:{server.server_port}/metrics",
              file=sys.stderr, flush=True)
    info = d.info
    print(f"mlxd engine ready: {info.served_model_name} on {d.endpoint} "
          f"(max_model_len {info.max_model_len}, {info.num_kv_blocks} KV blocks of {info.block_size})",
          file=sys.stderr, flush=True)
    return d.run()


@contextlib.contextmanager
def _progress(what: str):
    """An elapsed-time bar on a terminal while ``what`` runs (the load reports no fractions)."""
    if not sys.stderr.isatty():
        yield
        return
    from tqdm import tqdm

    done = threading.Event()
    bar = tqdm(desc=what, bar_format="{desc}: {elapsed}", file=sys.stderr)

    def tick():
        while not done.wait(0.2):
            bar.refresh()

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        bar.close()


def main(argv: list[str] | None = None) -> int:
    from shared.cli import main as cli_main

    return cli_main(["engine", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
