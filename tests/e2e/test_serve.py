"""`mlxd serve`: one command starts the engine and the gateway; Ctrl-C stops both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from tests.e2e.servers import free_port


def test_serve_runs_engine_and_gateway_and_ctrl_c_stops_both(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", "--port", str(port),
         "--engine-endpoint", f"ipc://{tmp_path}/engine.sock", "--num-kv-blocks", "32",
         "--max-model-len", "256", "--max-num-batched-tokens", "128", "--shutdown-timeout", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True)  # its own process group, as a terminal's Ctrl-C would see it
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mlxd serve did not become healthy"
            time.sleep(0.25)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        assert "SmolLM2" in model  # the embedded default
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4)
        assert r.choices[0].message.content is not None
        engine_pids = subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True,
                                     text=True).stdout.split()
        assert len(engine_pids) == 1

        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
        try:
            serve.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGUSR1)  # stacks into the log, to see what hangs
            time.sleep(1)
            raise AssertionError((tmp_path / "serve.log").read_text()[-6000:]) from None
        assert serve.returncode == 0
        time.sleep(0.5)
        assert not os.path.exists(f"/proc/{engine_pids[0]}") or \
            open(f"/proc/{engine_pids[0]}/stat").read().split()[2] == "Z"
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        log.close()
