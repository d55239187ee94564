"""The service managers (launchd, systemd) and the verbs common to both."""

from __future__ import annotations

import sys

from mlxd.service.jobs import Job
from mlxd.service.launchd import LaunchdManager
from mlxd.service.systemd import SystemdManager


def default_manager() -> str:
    return "launchd" if sys.platform == "darwin" else "systemd"


def make_manager(name: str):
    if name == "launchd":
        return LaunchdManager()
    if name == "systemd":
        return SystemdManager()
    raise ValueError(f"unknown service manager {name!r}; 'launchd' or 'systemd'")


# The verbs that talk to the manager's session (uninstall removes its files without one; logs reads files).
SESSION_VERBS = ("install", "start", "stop", "restart", "status")


def run(verb: str, manager, jobs: list[Job] | None = None, *, keep_logs: bool = False,
        lines: int = 50, follow: bool = False) -> int:
    """Carry out one `mlxd service` verb; returns the exit code."""
    if verb == "install":
        manager.install(jobs)
        print(f"mlxd service installed ({manager.describe()})", file=sys.stderr)
        return 0
    if verb == "uninstall":
        problems = manager.uninstall(keep_logs=keep_logs)
        for line in problems:
            print(f"mlxd service uninstall: {line}", file=sys.stderr)
        print("mlxd service uninstalled" + (", with the problems above" if problems else ""), file=sys.stderr)
        return 1 if problems else 0
    if verb in ("start", "stop", "restart", "status"):
        return getattr(manager, verb)()
    if verb == "logs":
        return manager.logs(lines=lines, follow=follow)
    raise ValueError(f"unknown verb {verb!r}")
