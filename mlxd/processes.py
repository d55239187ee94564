"""`mlxd engine` and `mlxd gateway`: one process each."""

from __future__ import annotations

from mlxd.flags import build_config
from shared.config import EngineConfig
from shared.serve_config import DaemonConfig, GatewayConfig


def engine(args) -> int:
    from engined.process import run_engine

    return run_engine(build_config(EngineConfig, args), build_config(DaemonConfig, args),
                      parent_pid=args.parent_pid, ready_fd=args.ready_fd)


def gateway(args) -> int:
    from gateway.server import run_gateway

    return run_gateway(build_config(GatewayConfig, args))
