"""Which project files one plain streamed chat request enters, in both processes, in order.

Starts an engine and a gateway on the embedded model, each under
``bench.trace.recorder``, sends one warm-up request, then records exactly one
streamed `/v1/chat/completions` request (the official openai SDK) and prints
the files each process entered while it ran, first entry first: the list
DESIGN.md keeps.

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-trace-"))
    endpoint, port = f"ipc://{tmp}/engine.sock", _free_port()
    os.chmod(tmp, 0o700)
    rec = [sys.executable, "-m", "bench.trace.recorder"]
    engine = subprocess.Popen(rec + [str(tmp / "engine.json"), "--", "engine", "--engine-endpoint", endpoint,
                                     "--kv-cache-memory", "200000000", "--max-model-len", "2048"])
    gateway = subprocess.Popen(rec + [str(tmp / "gateway.json"), "--", "gateway", "--engine-endpoint", endpoint,
                                      "--port", str(port)])
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
        files = {name: json.loads((tmp / f"{name}.json").read_text()) for name in ("gateway", "engine")}
    finally:
        for p in (gateway, engine):
            p.terminate()
            p.wait(30)
    print(f"reply: {text!r}\n")
    total = []
    for name in ("gateway", "engine"):
        print(f"{name}: {len(files[name])} files")
        for f in files[name]:
            print(f"  {f}")
            if f not in total:
                total.append(f)
    print(f"\n{len(total)} distinct project files")


if __name__ == "__main__":
    main()
