"""What `mlxd service` installs, and the verbs common to both managers.

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


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` whole, so a manager reading it never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def default_manager() -> str:
    return "launchd" if sys.platform == "darwin" else "systemd"


def make_manager(name: str):
    if name == "launchd":
        from launchd.launchctl import LaunchdManager

        return LaunchdManager()
    if name == "systemd":
        from launchd.systemd import SystemdManager

        return SystemdManager()
    raise ValueError(f"unknown service manager {name!r}; 'launchd' or 'systemd'")


def run(verb: str, manager, jobs: list[Job] | None = None, *, keep_logs: bool = False,
        lines: int = 50, follow: bool = False) -> int:
    """Carry out one `mlxd service` verb; returns the exit code."""
    if verb == "install":
        manager.install(jobs)
        print(f"mlxd service installed ({manager.describe()})", file=sys.stderr)
        return 0
    if verb == "uninstall":
        manager.uninstall(keep_logs=keep_logs)
        print("mlxd service uninstalled", file=sys.stderr)
        return 0
    if verb in ("start", "stop", "restart", "status"):
        return getattr(manager, verb)()
    if verb == "logs":
        return manager.logs(lines=lines, follow=follow)
    raise ValueError(f"unknown verb {verb!r}")
