"""LaunchAgents in ~/Library/LaunchAgents, driven by launchctl's domain verbs (macOS 10.11+).

``bootstrap gui/<uid> PLIST`` loads and (RunAtLoad) starts a job, ``bootout
gui/<uid>/LABEL`` stops and unloads it, ``kickstart -k`` restarts it, and
``print`` tells whether it is loaded. A re-install boots the old job out
first: launchd keeps the definition it loaded, not the file.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
from collections import deque
from pathlib import Path

from mlxd.service.jobs import TEMPLATES, Job, call, call_captured, installed_job_names, write_atomic

LABEL_PREFIX = "local.mlxd."


class NotInstalledError(RuntimeError):
    pass


class NoSessionError(RuntimeError):
    pass


class LaunchdManager:
    def __init__(self, home: str | None = None, uid: int | None = None):
        self.home = Path(home or os.path.expanduser("~"))
        self.uid = os.getuid() if uid is None else uid
        self.agents_dir = self.home / "Library" / "LaunchAgents"
        self.logs_dir = self.home / "Library" / "Logs" / "mlxd"

    @property
    def domain(self) -> str:
        return f"gui/{self.uid}"

    @property
    def job_names(self) -> list[str]:
        """The installed jobs in start order (stopped in reverse)."""
        return installed_job_names(p.name[len(LABEL_PREFIX):-len(".plist")]
                                   for p in self.agents_dir.glob(LABEL_PREFIX + "*.plist"))

    def label(self, name: str) -> str:
        return LABEL_PREFIX + name

    def plist_path(self, name: str) -> Path:
        return self.agents_dir / f"{self.label(name)}.plist"

    def log_paths(self, name: str) -> tuple[Path, Path]:
        return self.logs_dir / f"{name}.log", self.logs_dir / f"{name}.err.log"

    def describe(self) -> str:
        return f"launchd agents {', '.join(map(self.label, self.job_names))} in {self.agents_dir}"

    def render(self, job: Job) -> bytes:
        with open(TEMPLATES / "agent.plist", "rb") as f:
            plist = plistlib.load(f)
        out, err = self.log_paths(job.name)
        plist.update({
            "Label": self.label(job.name),
            "ProgramArguments": list(job.argv),
            "EnvironmentVariables": dict(job.env),
            "WorkingDirectory": str(self.home),
            "StandardOutPath": str(out),
            "StandardErrorPath": str(err),
        })
        return plistlib.dumps(plist, sort_keys=True)

    def require_session(self) -> None:
        """Raise NoSessionError, one line with the fix, unless this user's GUI domain exists."""
        rc, err = call_captured(["launchctl", "print", self.domain])
        if rc != 0:
            raise NoSessionError(f"no GUI login session for uid {self.uid} ({err or f'launchctl exited {rc}'}): "
                                 f"LaunchAgents run in one; log in to this Mac's desktop (over ssh too, the "
                                 f"user must be logged in there), or run `mlxd serve` under another supervisor")

    def _loaded(self, name: str) -> bool:
        return call(["launchctl", "print", f"{self.domain}/{self.label(name)}"], quiet=True) == 0

    def _bootout(self, name: str) -> int:
        if self._loaded(name):
            return call(["launchctl", "bootout", f"{self.domain}/{self.label(name)}"])
        return 0

    def _bootstrap(self, name: str) -> int:
        return call(["launchctl", "bootstrap", self.domain, str(self.plist_path(name))])

    def install(self, jobs: list[Job]) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        # A set of another size installed before: its agents go first.
        for name in self.job_names:
            if name not in {j.name for j in jobs} and self.plist_path(name).exists():
                self._bootout(name)
                self.plist_path(name).unlink()
        for job in sorted(jobs, key=lambda j: j.name == "gateway"):
            write_atomic(self.plist_path(job.name), self.render(job))
            self._bootout(job.name)
            if self._bootstrap(job.name) != 0:
                raise RuntimeError(f"launchctl bootstrap of {self.plist_path(job.name)} failed")

    def uninstall(self, keep_logs: bool = False) -> list[str]:
        """Boot out and remove the agents (and logs); returns what went wrong (the files go all the same)."""
        problems = []
        for name in reversed(self.job_names):
            if self._bootout(name) != 0:
                problems.append(f"`launchctl bootout {self.domain}/{self.label(name)}` failed (its message is "
                                f"above): the job may run until the next logout")
            self.plist_path(name).unlink(missing_ok=True)
        if not keep_logs and self.logs_dir.exists():
            shutil.rmtree(self.logs_dir)
        return problems

    def _require_installed(self) -> None:
        missing = [str(self.plist_path(n)) for n in self.job_names if not self.plist_path(n).exists()]
        if missing:
            raise NotInstalledError(f"not installed ({', '.join(missing)} missing); run `mlxd service install`")

    def start(self) -> int:
        self._require_installed()
        rc = 0
        for name in self.job_names:
            if self._loaded(name):
                rc |= call(["launchctl", "kickstart", f"{self.domain}/{self.label(name)}"])
            else:
                rc |= self._bootstrap(name)
        return rc

    def stop(self) -> int:
        # Booted out, not killed: KeepAlive would start a killed job again. The
        # plists stay, so the jobs come back at the next login or `start`.
        for name in reversed(self.job_names):
            self._bootout(name)
        return 0

    def restart(self) -> int:
        self._require_installed()
        rc = 0
        for name in self.job_names:
            if self._loaded(name):
                rc |= call(["launchctl", "kickstart", "-k", f"{self.domain}/{self.label(name)}"])
            else:
                rc |= self._bootstrap(name)
        return rc

    def status(self) -> int:
        rc = 0
        for name in self.job_names:
            rc |= call(["launchctl", "print", f"{self.domain}/{self.label(name)}"])
        return rc

    def logs(self, lines: int = 50, follow: bool = False) -> int:
        files = [p for name in self.job_names for p in self.log_paths(name) if p.exists()]
        if not files:
            print(f"no logs in {self.logs_dir}")
            return 1
        if follow:
            return subprocess.run(["tail", "-n", str(lines), "-F", *map(str, files)]).returncode
        for path in files:
            print(f"==> {path} <==")
            with open(path, errors="replace") as f:
                print("".join(deque(f, maxlen=lines)), end="")
        return 0
