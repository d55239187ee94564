"""`--api-key-file`: the key `mlxd service install` keeps off command lines reaches the gateway."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.e2e.servers import Gateway, _env


def test_a_gateway_requires_the_key_read_from_its_file(engine, tmp_path):
    key_file = tmp_path / "key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"k-from-file\n")
    os.close(fd)
    gateway = Gateway(engine.endpoint, str(tmp_path / "gateway.log"), extra=["--api-key-file", str(key_file)])
    gateway.start()
    try:
        gateway.wait_healthy()
        assert httpx.get(gateway.url + "/v1/models").status_code == 401
        ok = httpx.get(gateway.url + "/v1/models", headers={"Authorization": "Bearer k-from-file"})
        assert ok.status_code == 200
        r = subprocess.run(["ps", "-o", "args=", "-p", str(gateway.proc.pid)], capture_output=True, text=True)
        assert "k-from-file" not in r.stdout
    finally:
        gateway.stop()


def test_a_missing_key_file_stops_the_gateway_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mlxd", "gateway", "--api-key-file", str(tmp_path / "none"),
                        "--engine-endpoint", "tcp://127.0.0.1:9"], capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--api-key-file" in r.stderr, r.stderr
