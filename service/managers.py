"""The service managers (launchd, systemd) and the verbs common to both."""

from __future__ import annotations

import sys

from service.jobs import Job
from service.launchd import LaunchdManager
from service.systemd import SystemdManager


def default_manager() -> str:
    return "launchd" if sys.platform == "darwin" else "systemd"


def make_manager(name: str):
    if name == "launchd":
        return LaunchdManager()
    if name == "systemd":
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
