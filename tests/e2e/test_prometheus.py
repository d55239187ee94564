"""A real Prometheus server scrapes the engine, and every Grafana panel's query returns data.

The dashboard's PromQL is evaluated by Prometheus itself against the live
engine's metrics, so a renamed metric or a broken expression fails here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.servers import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "dashboards" / "mlxd.json"


@pytest.fixture(scope="module")
def prometheus(engine, gateway, metrics_port, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "the prometheus server is not installed (Debian package `prometheus`; .ci/run installs it)"
    d = tmp_path_factory.mktemp("prometheus")
    (d / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: mlxd-engine\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n"
    )
    port = free_port()
    log = open(d / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: query(url, 'up{job="mlxd-engine"}') == [1.0], 60, "engine scraped")
        yield url
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def query(url: str, expr: str) -> list[float]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    # Prometheus answers a plain-text 503 until its storage is open.
    assert r.status_code == 200, (expr, r.status_code, r.text[:200])
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return [float(s["value"][1]) for s in body["data"]["result"]]


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, AssertionError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not {what} after {timeout}s")


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("${prefix}", "mlxd").replace("$model", ".*")
                    .replace("$__rate_interval", "1m"))
            out.append((panel["title"], expr))
    return out


def test_every_dashboard_query_returns_data_from_a_live_engine(prometheus, client, model):
    def traffic():
        for i in range(3):
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Say hello {i}."}], max_tokens=8, stream=True)
            for _ in stream:
                pass

    traffic()
    time.sleep(2.5)  # two scrapes apart, so rates have two samples
    traffic()
    wait_for(lambda: (query(prometheus, "rate(mlxd:generation_tokens_total[1m])") or [0])[0] > 0, 30,
             "generation rate visible")
    for title, expr in panel_queries():
        if "spec_decode_" in expr:
            # Served only by an engine that speculates, as in vLLM; this one does not.
            assert not query(prometheus, expr), f"panel {title!r}: spec-decode series without speculation"
            continue
        assert query(prometheus, expr), f"panel {title!r}: no series for {expr}"
    # The numbers mean what they say.
    assert query(prometheus, "histogram_quantile(0.5, sum by (le) (rate(mlxd:time_to_first_token_seconds_bucket[1m])))")[0] > 0
    assert query(prometheus, 'process_resident_memory_bytes{job="mlxd-engine"}')[0] > 50e6
    assert query(prometheus, "mlxd:kv_cache_blocks_total")[0] > 0
    # vLLM's names under the mlxd: prefix, with the model_name label dashboards filter on.
    names = httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"]
    for metric in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                   "request_success_total", "prompt_tokens_total", "generation_tokens_total"):
        assert f"mlxd:{metric}" in names
    assert query(prometheus, f'count(mlxd:num_requests_running{{model_name="{model}"}})') == [1.0]
