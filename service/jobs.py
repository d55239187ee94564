"""What `mlxd service` installs, and the helpers both managers share.

A service is two jobs, the engine and one gateway, each its own process under
the manager so that either restarts alone: a gateway reconnects to a
restarted engine by itself, and a restarted gateway loses nothing queued in
the engine. Both get the engine's endpoint written out in full, resolved at
install time, so they agree on it whatever environment the manager gives them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
# Variables worth carrying from the installing shell into the services: where
# models, keys and the socket are. Anything else is given with --env.
PASSED_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR",
              "MLX_METAL_DEBUG")


@dataclass
class Job:
    """One background process: ``name`` is "engine" or "gateway"."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def service_env(extra: list[str]) -> dict[str, str]:
    """The services' environment: unbuffered logs, a PATH with this Python's bin, and ``KEY=VALUE``s."""
    env = {"PYTHONUNBUFFERED": "1",
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"])}
    for name in PASSED_ENV:
        if os.environ.get(name):
            env[name] = os.environ[name]
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env takes KEY=VALUE, not {item!r}")
        env[key] = value
    return env


def call(argv: list[str], quiet: bool = False) -> int:
    """Run a manager command (launchctl, systemctl, journalctl) found on PATH; its exit code.

    ``quiet`` hides its output (a probe such as `launchctl print`).
    """
    exe = shutil.which(argv[0])
    if exe is None:
        raise FileNotFoundError(f"{argv[0]} is not on PATH")
    out = subprocess.DEVNULL if quiet else None
    return subprocess.run([exe, *argv[1:]], stdout=out, stderr=out).returncode


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` whole, so a manager reading it never sees half a file.

    The temporary file is created with ``mode`` already, so a secret is never
    readable by others, not even briefly.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
