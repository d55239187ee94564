"""A pipeline's (or tensor-parallel group's) ranks on this machine: `mlxd engine -pp N` starts ranks 1..N-1.

Across machines, mlx.launch starts one `mlxd engine` per host and sets each one's
MLX_RANK and MLX_HOSTFILE; on one machine (tests, a Mac with a GPU to share) this
does the same over loopback: a ring hostfile of free local ports, and one child
per rank past 0 running the same engine flags. The children stop with this
process: rank 0's going away ends their link, and before the link is up they
watch this process (``--parent-pid``).

On a host with an NVIDIA GPU for every rank, each rank is given its own
(``CUDA_VISIBLE_DEVICES``, which the CUDA runtime reads once, when the process
first touches a GPU: nothing has by the time this runs) and NCCL's rendezvous,
which the tensor-parallel collectives use (``engined/parallel/pipeline.py``).
Fewer GPUs than ranks: they all share the one MLX picks, over the ring alone.
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


# One directory per NVIDIA GPU the driver sees, readable without starting CUDA in this process.
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def gpus_for(size: int, visible: str | None, count: int) -> list[str] | None:
    """Each of ``size`` ranks' ``CUDA_VISIBLE_DEVICES``: its own GPU of those ``visible`` (the
    variable as this process got it) or else of the ``count`` the driver sees; None where there
    are fewer GPUs than ranks (NCCL refuses two ranks on one GPU)."""
    gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible is not None else \
        [str(i) for i in range(count)]
    return gpus[:size] if len(gpus) >= size else None


def _driver_gpus() -> int:
    try:
        return len(os.listdir(NVIDIA_GPUS))
    except OSError:
        return 0


def start_local(config: EngineConfig, log_level: str | None = None) -> list[subprocess.Popen]:
    """Start ranks 1..N-1 of ``config``'s pipeline here, logging at ``log_level`` (rank 0's; default
    INFO); this process becomes rank 0."""
    size = config.num_ranks
    hosts = [[f"127.0.0.1:{_free_port()}"] for _ in range(size)]
    fd, hostfile = tempfile.mkstemp(prefix="mlxd-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(hosts, f)
    shared = {"MLX_HOSTFILE": hostfile}
    gpus = gpus_for(size, os.environ.get("CUDA_VISIBLE_DEVICES"), _driver_gpus())
    if gpus:
        shared.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(_free_port()), MLX_WORLD_SIZE=str(size))
    flags = [*to_flags(config), *(["--log-level", log_level] if log_level else [])]
    children = []
    for rank in range(1, size):
        env = {**os.environ, **shared, LAUNCHED: str(rank), **({"CUDA_VISIBLE_DEVICES": gpus[rank]} if gpus else {})}
        children.append(subprocess.Popen(
            [sys.executable, "-m", "mlxd", "engine", *flags, "--parent-pid", str(os.getpid())], env=env))
    os.environ.update({**shared, LAUNCHED: "0", **({"CUDA_VISIBLE_DEVICES": gpus[0]} if gpus else {})})
    return children
