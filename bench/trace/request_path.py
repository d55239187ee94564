"""Which project files one plain streamed chat request enters, in both processes, in order.

Starts an engine and a gateway on the embedded model, each under
``bench.trace.recorder`` (no key file, so no key is matched), sends one
warm-up request, then records exactly one streamed `/v1/chat/completions`
request (the official openai SDK) and prints the files each process entered
while it ran, first entry first, and the lines DESIGN.md's "One request's
path" keeps (``tests/bench/test_request_path.py`` holds DESIGN.md to them).

    python -m bench.trace.request_path
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = ("gateway", "engine")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trace() -> tuple[dict[str, list[str]], str]:
    """({process: the project files it entered while the request ran, first entry first}, the reply).

    The threads of a process interleave, so the order is that of first entry
    in this run, not a call chain; the set of files is what a request needs.
    """
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-trace-"))
    endpoint, port = f"ipc://{tmp}/engine.sock", _free_port()
    os.chmod(tmp, 0o700)
    rec = [sys.executable, "-m", "mlxd.bench.trace.recorder"]
    engine = subprocess.Popen(rec + [str(tmp / "engine.json"), "--", "engine", "--engine-endpoint", endpoint,
                                     "--num-kv-blocks", "256", "--max-model-len", "2048"], cwd=ROOT)
    gateway = subprocess.Popen(rec + [str(tmp / "gateway.json"), "--", "gateway", "--engine-endpoint", endpoint,
                                      "--port", str(port), "--keys-file", str(tmp / "keys.json")], cwd=ROOT)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 600
        while True:
            try:
                model = client.models.list().data[0].id
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

        def ask() -> str:
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Name three colours."}],
                max_tokens=8, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        ask()  # warm-up: first-use paths (template compile, kernels) are not the request's path
        for p in (engine, gateway):
            p.send_signal(signal.SIGUSR2)
        time.sleep(0.5)
        text = ask()
        for p in (engine, gateway):
            p.send_signal(signal.SIGUSR2)
        time.sleep(1.0)
        files = {name: json.loads((tmp / f"{name}.json").read_text()) for name in PROCESSES}
    finally:
        for p in (gateway, engine):
            p.terminate()
            p.wait(30)
    return files, text


def distinct(files: dict[str, list[str]]) -> list[str]:
    """The files of every process, each once (``shared/`` is on both sides)."""
    return list(dict.fromkeys(f for name in PROCESSES for f in files[name]))


def design_lines(files: dict[str, list[str]]) -> list[str]:
    """The lines of DESIGN.md's "One request's path" that name the files: one per process, then the count."""
    lines = [f"- **{name}** ({len(files[name])} files): " + ", ".join(f"`{f}`" for f in files[name])
             for name in PROCESSES]
    return lines + [f"{len(distinct(files))} distinct project files."]


def main() -> None:
    files, text = trace()
    print(f"reply: {text!r}\n")
    for name in PROCESSES:
        print(f"{name}: {len(files[name])} files")
        for f in files[name]:
            print(f"  {f}")
    print(f"\n{len(distinct(files))} distinct project files\n\nfor DESIGN.md:\n")
    print("\n".join(design_lines(files)))


if __name__ == "__main__":
    main()
