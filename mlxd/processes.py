"""`mlxd engine` and `mlxd gateway`: one process each."""

from __future__ import annotations

import os

from mlxd import ranks as mlxd_ranks
from mlxd.flags import build_config
from mlxd.ports import check_free
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.serve_config import DaemonConfig, GatewayConfig


def _load_env_file(args) -> None:
    """``--env-file``: its variables set before the process's own modules are imported (some,
    Hugging Face's, read the environment then)."""
    if args.env_file:
        from mlxd.service.jobs import read_env_file

        try:
            os.environ.update(read_env_file(args.env_file))
        except OSError as e:
            raise InvalidRequestError(f"--env-file {args.env_file}: {e.strerror}", param="env_file") from None


def engine(args) -> int:
    _load_env_file(args)
    from mlxd.engined.process import run_engine

    daemon = build_config(DaemonConfig, args)
    config = build_config(EngineConfig, args)
    # Found now, not after a load that can take minutes.
    check_free(daemon.metrics_host, daemon.metrics_port, "--metrics-port")
    ranks = []
    if config.num_ranks > 1 and not mlxd_ranks.launched():
        ranks = mlxd_ranks.start_local(config, args.log_level)
    try:
        return run_engine(config, daemon, parent_pid=args.parent_pid, ready_fd=args.ready_fd)
    finally:
        for rank in ranks:
            rank.terminate()
        for rank in ranks:
            rank.wait()


def gateway(args) -> int:
    _load_env_file(args)
    from mlxd.gateway.server import run_gateway

    config = build_config(GatewayConfig, args)
    check_free(config.host, config.port, "--port")
    return run_gateway(config)
