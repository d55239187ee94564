"""A pipeline's (or tensor-parallel group's) ranks on this machine: `mlxd engine -pp N` starts ranks 1..N-1.

Across machines, mlx.launch starts one `mlxd engine` per host and sets each one's
MLX_RANK and MLX_HOSTFILE; on one machine (tests, a Mac with a GPU to share) this
does the same over loopback: a ring hostfile of free local ports, and one child
per rank past 0 running the same engine flags. The children stop with this
process: rank 0's going away ends their link, and before the link is up they
watch this process (``--parent-pid``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

from mlxd.flags import to_flags
from mlxd.shared.config import EngineConfig

LAUNCHED = "MLX_RANK"  # set by mlx.launch (or by this module) for each rank it starts


def launched() -> bool:
    return LAUNCHED in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local(config: EngineConfig, log_level: str | None = None) -> list[subprocess.Popen]:
    """Start ranks 1..N-1 of ``config``'s pipeline here, logging at ``log_level`` (rank 0's; default
    INFO); this process becomes rank 0."""
    size = config.num_ranks
    hosts = [[f"127.0.0.1:{_free_port()}"] for _ in range(size)]
    fd, hostfile = tempfile.mkstemp(prefix="mlxd-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(hosts, f)
    flags = [*to_flags(config), *(["--log-level", log_level] if log_level else [])]
    children = []
    for rank in range(1, size):
        env = {**os.environ, LAUNCHED: str(rank), "MLX_HOSTFILE": hostfile}
        children.append(subprocess.Popen(
            [sys.executable, "-m", "mlxd", "engine", *flags, "--parent-pid", str(os.getpid())], env=env))
    os.environ.update({LAUNCHED: "0", "MLX_HOSTFILE": hostfile})
    return children
