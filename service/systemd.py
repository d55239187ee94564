"""systemd user units in $XDG_CONFIG_HOME/systemd/user, driven by `systemctl --user`.

Logs go to the journal (`mlxd service logs` reads them with journalctl).
"""

from __future__ import annotations

import re
import string
from pathlib import Path

from service.jobs import TEMPLATES, Job, call, write_atomic
from shared.paths import xdg_home

JOB_NAMES = ("engine", "gateway")
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


class SystemdManager:
    def __init__(self, config_home: str | None = None):
        base = config_home or xdg_home("config")
        self.unit_dir = Path(base) / "systemd" / "user"

    def unit(self, name: str) -> str:
        return f"mlxd-{name}.service"

    def unit_path(self, name: str) -> Path:
        return self.unit_dir / self.unit(name)

    @property
    def units(self) -> list[str]:
        return [self.unit(n) for n in JOB_NAMES]

    def describe(self) -> str:
        return f"systemd user units {', '.join(self.units)} in {self.unit_dir}"

    def render(self, job: Job) -> bytes:
        template = string.Template((TEMPLATES / "unit.service").read_text())
        env = "\n".join(f"Environment={_quote(f'{k}={v}', command=False)}" for k, v in sorted(job.env.items()))
        return template.substitute(
            description=f"mlxd {job.name}",
            # The gateway after the engine only to start in that order; it waits and reconnects by itself.
            after="network.target" if job.name == "engine" else f"network.target {self.unit('engine')}",
            exec_start=" ".join(map(_quote, job.argv)),
            environment=env,
        ).encode()

    def _systemctl(self, *args: str, quiet: bool = False) -> int:
        return call(["systemctl", "--user", *args], quiet=quiet)

    def install(self, jobs: list[Job]) -> None:
        for job in jobs:
            write_atomic(self.unit_path(job.name), self.render(job))
        if self._systemctl("daemon-reload") != 0:
            raise RuntimeError("systemctl --user daemon-reload failed (is there a user session bus?)")
        self._systemctl("enable", *self.units)
        # restart, not start: a re-install must run the new options.
        if self._systemctl("restart", *self.units) != 0:
            raise RuntimeError(f"systemctl --user restart {' '.join(self.units)} failed")

    def uninstall(self, keep_logs: bool = False) -> None:
        # The journal is the system's, not ours: keep_logs changes nothing here.
        if any(self.unit_path(n).exists() for n in JOB_NAMES):
            self._systemctl("disable", "--now", *self.units)
        for name in JOB_NAMES:
            self.unit_path(name).unlink(missing_ok=True)
        self._systemctl("daemon-reload")

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
