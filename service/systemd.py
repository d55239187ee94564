"""systemd user units in $XDG_CONFIG_HOME/systemd/user, driven by `systemctl --user`.

Logs go to the journal (`mlxd service logs` reads them with journalctl).
Without a user manager to talk to (no login session, no lingering: a
container, an ssh session on a host without logind) require_session says so in
one line, with the fix; `mlxd service` asks it before any verb that needs one.
"""

from __future__ import annotations

import getpass
import re
import string
from pathlib import Path

from mlxd.service.jobs import TEMPLATES, Job, call, call_captured, installed_job_names, write_atomic
from mlxd.shared.paths import xdg_home

_BARE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def _quote(word: str, command: bool = True) -> str:
    """One ExecStart (``command``) or Environment word as systemd reads it, taken literally.

    Specifiers (%) are expanded in both; variables ($) only in a command line.
    """
    word = word.replace("%", "%%")
    if command:
        word = word.replace("$", "$$")
    if _BARE.fullmatch(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


class NoUserSessionError(RuntimeError):
    pass


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, no $USER (a bare container)
        return "$USER"


class SystemdManager:
    def __init__(self, config_home: str | None = None):
        base = config_home or xdg_home("config")
        self.unit_dir = Path(base) / "systemd" / "user"

    def unit(self, name: str) -> str:
        return f"mlxd-{name}.service"

    def unit_path(self, name: str) -> Path:
        return self.unit_dir / self.unit(name)

    @property
    def job_names(self) -> list[str]:
        return installed_job_names(p.name[len("mlxd-"):-len(".service")]
                                   for p in self.unit_dir.glob("mlxd-*.service"))

    @property
    def units(self) -> list[str]:
        return [self.unit(n) for n in self.job_names]

    def describe(self) -> str:
        return f"systemd user units {', '.join(self.units)} in {self.unit_dir}"

    def render(self, job: Job) -> bytes:
        template = string.Template((TEMPLATES / "unit.service").read_text())
        env = "\n".join(f"Environment={_quote(f'{k}={v}', command=False)}" for k, v in sorted(job.env.items()))
        return template.substitute(
            description=f"mlxd {job.name}",
            # The gateway after the engine only to start in that order; it waits and reconnects by itself.
            after=("network.target" if job.name != "gateway" else
                   " ".join(["network.target", *(self.unit(n) for n in self.job_names if n != "gateway")])),
            exec_start=" ".join(map(_quote, job.argv)),
            environment=env,
        ).encode()

    def _systemctl(self, *args: str, quiet: bool = False) -> int:
        return call(["systemctl", "--user", *args], quiet=quiet)

    def require_session(self) -> None:
        """Raise NoUserSessionError, one line with the fix, unless `systemctl --user` reaches a manager."""
        rc, err = call_captured(["systemctl", "--user", "show-environment"])
        if rc != 0:
            user = _user()
            raise NoUserSessionError(
                f"no systemd user session for {user} here ({err or f'systemctl --user exited {rc}'}); "
                f"run `sudo loginctl enable-linger {user}` (a user manager that runs without a login) "
                f"and log in again, or run `mlxd serve` under another supervisor")

    def install(self, jobs: list[Job]) -> None:
        # A set of another size installed before: its units go first.
        stale = [n for n in self.job_names if n not in {j.name for j in jobs} and self.unit_path(n).exists()]
        if stale:
            self._systemctl("disable", "--now", *map(self.unit, stale))
            for name in stale:
                self.unit_path(name).unlink()
        # Engines first: the gateway's unit names them (render's After=).
        for job in sorted(jobs, key=lambda j: j.name == "gateway"):
            write_atomic(self.unit_path(job.name), self.render(job))
        for verb in ("daemon-reload", "enable"):
            if self._systemctl(verb, *(self.units if verb == "enable" else ())) != 0:
                raise RuntimeError(f"systemctl --user {verb} failed (its message is above)")
        # restart, not start: a re-install must run the new options.
        if self._systemctl("restart", *self.units) != 0:
            raise RuntimeError(f"systemctl --user restart {' '.join(self.units)} failed")

    def uninstall(self, keep_logs: bool = False) -> list[str]:
        """Stop, disable and remove the units; returns what went wrong (the files go all the same)."""
        # The journal is the system's, not ours: keep_logs changes nothing here.
        problems = []
        names = self.job_names
        if any(self.unit_path(n).exists() for n in names):
            rc, err = call_captured(["systemctl", "--user", "disable", "--now", *self.units])
            if rc != 0:
                problems.append(f"`systemctl --user disable --now` failed ({err or f'exit {rc}'}): the unit "
                                f"files are removed, but a unit still running keeps running until its user "
                                f"manager stops it")
        for name in names:
            self.unit_path(name).unlink(missing_ok=True)
        if not problems:
            self._systemctl("daemon-reload")
        return problems

    def start(self) -> int:
        return self._systemctl("start", *self.units)

    def stop(self) -> int:
        return self._systemctl("stop", *reversed(self.units))

    def restart(self) -> int:
        return self._systemctl("restart", *self.units)

    def status(self) -> int:
        return self._systemctl("status", "--no-pager", *self.units)

    def logs(self, lines: int = 50, follow: bool = False) -> int:
        argv = ["journalctl", "--user", "--no-pager", "-n", str(lines)]
        for u in self.units:
            argv += ["-u", u]
        return call(argv + (["-f"] if follow else []))
