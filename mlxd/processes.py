"""`mlxd engine` and `mlxd gateway`: one process each."""

from __future__ import annotations

from mlxd.flags import build_config
from mlxd.ports import check_free
from shared.config import EngineConfig
from shared.serve_config import DaemonConfig, GatewayConfig


def engine(args) -> int:
    from engined.process import run_engine

    daemon = build_config(DaemonConfig, args)
    # Found now, not after a load that can take minutes.
    check_free(daemon.metrics_host, daemon.metrics_port, "--metrics-port")
    return run_engine(build_config(EngineConfig, args), daemon,
                      parent_pid=args.parent_pid, ready_fd=args.ready_fd)


def gateway(args) -> int:
    from gateway.server import run_gateway

    config = build_config(GatewayConfig, args)
    check_free(config.host, config.port, "--port")
    return run_gateway(config)
