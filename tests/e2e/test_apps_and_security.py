"""Per-app keys on a real gateway, and the engine's secure defaults (socket directory, CurveZMQ)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxd.shared.curve import make_keys
from mlxd.shared.keys import add_key, revoke_key
from tests.e2e.servers import Engine, Gateway, _env, free_port

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


def _chat(gateway, key: str | None, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, **extra}, headers=headers,
                      timeout=120)


def _app_requests(metrics_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("app_requests"):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["app"]] = s.value
    return out


def test_app_keys_authenticate_tag_requests_and_revoke_at_once(engine, metrics_port, tmp_path):
    keys_file = str(tmp_path / "keys.json")
    alpha = add_key(keys_file, "alpha")
    gw = Gateway(engine.endpoint, str(tmp_path / "gateway.log"),
                 extra=["--keys-file", keys_file, "--api-key", "operator"]).start()
    try:
        gw.wait_healthy()
        before = _app_requests(metrics_port)
        r = _chat(gw, alpha, priority=-1)
        assert r.status_code == 200, r.text
        # The engine counted the request under the key's app: the tag crossed the wire.
        after = _app_requests(metrics_port)
        assert after.get("alpha", 0) == before.get("alpha", 0) + 1
        assert _chat(gw, "operator").status_code == 200  # --api-key still works beside the app keys

        assert _chat(gw, None).status_code == 401
        assert _chat(gw, alpha[:-1] + ("x" if alpha[-1] != "x" else "y")).status_code == 401
        # Revoked while the gateway runs: refused from the next request on, no restart.
        assert revoke_key(keys_file, "alpha")
        r = _chat(gw, alpha)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        # A new key of the same app works at once too.
        assert _chat(gw, add_key(keys_file, "alpha")).status_code == 200
    finally:
        gw.stop()


def _run_engine(*flags, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxd", "engine", *flags], capture_output=True, text=True,
                          timeout=timeout, env=_env())


def test_engine_refuses_a_socket_directory_others_can_write(tmp_path):
    shared_dir = tmp_path / "open"
    shared_dir.mkdir()
    os.chmod(shared_dir, 0o777)
    t0 = time.monotonic()
    r = _run_engine("--engine-endpoint", f"ipc://{shared_dir}/engine.sock")
    assert r.returncode != 0
    assert "writable by other users" in r.stderr and str(shared_dir) in r.stderr
    assert time.monotonic() - t0 < 30  # refused before the model loads
    assert not (shared_dir / "engine.sock").exists()
    # The default runtime directory too.
    runtime = tmp_path / "xdg"
    (runtime / "mlxd").mkdir(parents=True)
    os.chmod(runtime / "mlxd", 0o777)
    r = subprocess.run([sys.executable, "-m", "mlxd", "engine"], capture_output=True, text=True, timeout=60,
                       env={**_env(), "XDG_RUNTIME_DIR": str(runtime)})
    assert r.returncode != 0 and "writable by other users" in r.stderr


def test_tcp_beyond_loopback_without_curve_keys_is_refused(tmp_path):
    r = _run_engine("--engine-endpoint", f"tcp://0.0.0.0:{free_port()}")
    assert r.returncode != 0 and "CurveZMQ" in r.stderr and "--curve-keys" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mlxd", "gateway", "--engine-endpoint",
                        "tcp://192.0.2.7:5555", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode != 0 and "CurveZMQ" in r.stderr


def test_gateway_talks_to_a_curve_engine_only_with_its_keys(tmp_path):
    keys = make_keys(str(tmp_path / "curve"))
    assert oct(os.stat(os.path.join(keys, "engine.key_secret")).st_mode & 0o777) == "0o600"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = Engine(endpoint, str(tmp_path / "engine.log"), extra=["--curve-keys", keys]).start()
    good = Gateway(endpoint, str(tmp_path / "good.log"), extra=["--curve-keys", keys]).start()
    plain = Gateway(endpoint, str(tmp_path / "plain.log")).start()
    # A gateway with keys of its own that the engine never authorized.
    stranger_keys = make_keys(str(tmp_path / "stranger"))
    shutil.copyfile(os.path.join(keys, "engine.key"), os.path.join(stranger_keys, "engine.key"))
    stranger = Gateway(endpoint, str(tmp_path / "stranger.log"), extra=["--curve-keys", stranger_keys]).start()
    try:
        good.wait_healthy()
        r = _chat(good, None)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        # Both others had as long as the good one to handshake, and could not.
        for gw in (plain, stranger):
            assert gw.proc.poll() is None
            assert gw.health().status_code == 503
    finally:
        for p in (good, plain, stranger):
            p.stop()
        assert engine.stop() == 0
