"""Runs one `mlxd` process under a profile hook that records which project files a request enters.

    python -m bench.trace.recorder OUT.json -- engine|gateway FLAGS...

SIGUSR2 once starts recording (every thread), twice writes to OUT.json each
project file entered since, in the order first entered, and stops.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mlxd", "shared", "gateway", "engined", "service")


def main() -> int:
    out, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    seen: dict[str, None] = {}
    state = {"on": False}

    def hook(frame, event, arg):
        if event == "call" and state["on"]:
            path = frame.f_code.co_filename
            if path.startswith(str(ROOT)) and path not in seen:
                rel = os.path.relpath(path, ROOT)
                if rel.split(os.sep)[0] in PACKAGES:
                    seen[path] = None

    def toggle(signum, frame):
        if not state["on"]:
            state["on"] = True
            return
        state["on"] = False
        Path(out).write_text(json.dumps([os.path.relpath(p, ROOT) for p in seen]))

    signal.signal(signal.SIGUSR2, toggle)
    sys.setprofile(hook)
    threading.setprofile(hook)
    from mlxd.cli import main as mlxd_main

    return mlxd_main(argv)


if __name__ == "__main__":
    sys.exit(main())
