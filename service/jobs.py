"""What `mlxd service` installs, and the helpers both managers share.

A service is two jobs, the engine and one gateway, each its own process under
the manager so that either restarts alone: a gateway reconnects to a
restarted engine by itself, and a restarted gateway loses nothing queued in
the engine. Both get the engine's endpoint written out in full, resolved at
install time, so they agree on it whatever environment the manager gives them.

Both run the installed ``mlxd`` entry point, never ``python -m mlxd``: that
would put the working directory (the home directory, under a manager) first on
``sys.path``, so a stray ``~/shared/__init__.py`` would run as mlxd's own code.
Values given with ``--env`` may be tokens: they go into a 0600 file that the
processes read (``--env-file``), never into a unit, a plist or a command line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
# Variables worth carrying from the installing shell into the services: where
# models, keys and the socket are (paths, no secrets: they are written into the
# unit or plist). Anything else is given with --env.
PASSED_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR",
              "MLX_METAL_DEBUG")


# One model: an engine and a gateway. Several (mlxd/model_set.py): "engine-0", "engine-1", ... and a gateway.
DEFAULT_JOB_NAMES = ("engine", "gateway")
_JOB_NAME = re.compile(r"engine(-\d+)?|gateway")


def installed_job_names(stems) -> list[str]:
    """The job names among ``stems`` (the installed files' names), engines first in order, the gateway
    last (start order; stopped in reverse); DEFAULT_JOB_NAMES when none is installed."""
    found = [s for s in stems if _JOB_NAME.fullmatch(s)]
    if not found:
        return list(DEFAULT_JOB_NAMES)
    return sorted(found, key=lambda n: (n == "gateway", len(n), n))


@dataclass
class Job:
    """One background process: ``name`` is "engine" (or "engine-N" of a set of models) or "gateway"."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def service_env() -> dict[str, str]:
    """The environment written into the unit or plist: unbuffered logs, a PATH with this
    Python's bin, and the PASSED_ENV variables the installing shell has."""
    env = {"PYTHONUNBUFFERED": "1",
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"])}
    for name in PASSED_ENV:
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def env_items(items: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` items as a dict, for the 0600 environment file."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or "\n" in item or "\x00" in item:
            raise ValueError(f"--env takes KEY=VALUE on one line, not {item!r}")
        env[key] = value
    return env


def format_env_file(env: dict[str, str]) -> bytes:
    """One ``KEY=VALUE`` a line, the value taken literally to the end of its line."""
    return "".join(f"{k}={v}\n" for k, v in sorted(env.items())).encode()


def read_env_file(path: str) -> dict[str, str]:
    """What format_env_file wrote."""
    with open(path, encoding="utf-8") as f:
        return dict(line.rstrip("\n").partition("=")[::2] for line in f if line.strip())


def mlxd_command() -> str:
    """The ``mlxd`` entry point installed with this Python (a venv's bin, or the user scheme's)."""
    dirs = [os.path.dirname(sys.executable), sysconfig.get_path("scripts"),
            sysconfig.get_path("scripts", sysconfig.get_preferred_scheme("user"))]
    for d in dirs:
        path = os.path.join(d, "mlxd")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"the `mlxd` command is not installed for {sys.executable} (looked in "
                            f"{', '.join(dict.fromkeys(dirs))}); `pip install` mlxd there first")


def _exe(argv: list[str]) -> list[str]:
    exe = shutil.which(argv[0])
    if exe is None:
        raise FileNotFoundError(f"{argv[0]} is not on PATH")
    return [exe, *argv[1:]]


def call(argv: list[str], quiet: bool = False) -> int:
    """Run a manager command (launchctl, systemctl, journalctl) found on PATH; its exit code.

    ``quiet`` hides its output (a probe such as `launchctl print`).
    """
    out = subprocess.DEVNULL if quiet else None
    return subprocess.run(_exe(argv), stdout=out, stderr=out).returncode


def call_captured(argv: list[str]) -> tuple[int, str]:
    """Run a manager command, its output hidden; (exit code, the last line it wrote to stderr)."""
    r = subprocess.run(_exe(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       errors="replace")
    lines = [line.strip() for line in r.stderr.splitlines() if line.strip()]
    return r.returncode, lines[-1] if lines else ""


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
