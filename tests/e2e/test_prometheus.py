"""A real Prometheus scrapes an engine and a gateway, and every panel query of both dashboards returns data.

The engine serves vLLM's names (``--metrics-prefix vllm``): vLLM's own example
dashboard (its queries kept in grafana/vllm/dashboard_queries.json) and mlxd's
(grafana/dashboards/mlxd.json, its ``prefix`` variable set to vllm) are
evaluated by Prometheus itself after real load, so a renamed metric, a series
missing until some event, or a broken expression fails here.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml  # mlx-lm's dependency

from tests.e2e.servers import Engine, Gateway, free_port

ROOT = Path(__file__).resolve().parents[2]
MLXD_DASHBOARD = ROOT / "grafana" / "dashboards" / "mlxd.json"
VLLM_QUERIES = ROOT / "grafana" / "vllm" / "dashboard_queries.json"
# Instant queries run after the load: a window that still holds it (Grafana's $__rate_interval
# is four scrape intervals, the datasource's timeInterval).
WINDOW = "1m"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("prometheus")
    endpoint, metrics_port = f"tcp://127.0.0.1:{free_port()}", free_port()
    engine = Engine(endpoint, str(d / "engine.log"),
                    extra=["--metrics-port", str(metrics_port), "--metrics-prefix", "vllm"]).start()
    gateway = Gateway(endpoint, str(d / "gateway.log")).start()
    prom = None
    try:
        gateway.wait_healthy()
        (d / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n"
            f"  - job_name: mlxd-engine\n    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n"
            f"  - job_name: mlxd-gateway\n    static_configs:\n      - targets: ['127.0.0.1:{gateway.port}']\n"
        )
        binary = shutil.which("prometheus")
        assert binary, "the prometheus server is not installed (Debian package `prometheus`; .ci/run installs it)"
        port = free_port()
        log = open(d / "prometheus.log", "wb")
        prom = subprocess.Popen(
            [binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: sorted(query(url, "up")) == [1.0, 1.0], 60, "engine and gateway scraped")
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield url, client, client.models.list().data[0].id
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(15)
            log.close()
        gateway.stop()
        engine.stop()


def query(url: str, expr: str) -> list[float]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    # Prometheus answers a plain-text 503 until its storage is open.
    assert r.status_code == 200, (expr, r.status_code, r.text[:200])
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return [float(s["value"][1]) for s in body["data"]["result"]]


def label_values(url: str, definition: str) -> list[str]:
    """A Grafana variable's ``label_values(SELECTOR, LABEL)``, asked of Prometheus as Grafana asks it."""
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition)
    assert match, definition
    selector, label = match.groups()
    r = httpx.get(f"{url}/api/v1/label/{label}/values", params={"match[]": selector}, timeout=10)
    assert r.status_code == 200, (match, r.text[:200])
    return r.json()["data"]


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


def mlxd_panel_queries(model: str) -> list[tuple[str, str]]:
    dash = json.loads(MLXD_DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("${prefix}", "vllm").replace("$model", model)
             .replace("$__rate_interval", WINDOW))
            for panel in dash["panels"] for target in panel.get("targets", [])]


def vllm_panel_queries(model: str) -> list[tuple[str, str]]:
    table = json.loads(VLLM_QUERIES.read_text())
    return [(panel["title"], expr.replace("$model_name", model).replace("$__rate_interval", WINDOW))
            for panel in table["panels"] for expr in panel["queries"]]


def load(client, model: str) -> None:
    """Streams and whole answers, n > 1, a shared prefix: what the panels plot."""
    system = "You are a terse assistant. " * 8  # a shared prefix: the second request hits the cache
    for i in range(3):
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Hi {i}."}],
            max_tokens=8, stream=True)
        for _ in stream:
            pass
    client.completions.create(model=model, prompt="Count: 1, 2,", max_tokens=6, n=2)


def test_every_panel_of_both_dashboards_returns_data_after_real_load(served):
    url, client, model = served
    load(client, model)
    time.sleep(2.5)  # two scrapes apart, so rates have two samples
    load(client, model)
    wait_for(lambda: (query(url, f"rate(vllm:generation_tokens_total[{WINDOW}])") or [0])[0] > 0, 30,
             "generation rate visible")
    wait_for(lambda: query(url, f'sum(increase(http_requests_total{{job="mlxd-gateway"}}[{WINDOW}]))'), 30,
             "gateway requests visible")
    empty = []
    for title, expr in vllm_panel_queries(model) + mlxd_panel_queries(model):
        values = query(url, expr)
        if "spec_decode_" in expr:
            # Served only by an engine that speculates, as in vLLM; this one does not.
            assert not values, f"panel {title!r}: spec-decode series without speculation"
        elif not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {expr} -> {values}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    # Both dashboards' model variables list the served model.
    vllm_variable = json.loads(VLLM_QUERIES.read_text())["variables"]["model_name"]
    mlxd_variable = next(v for v in json.loads(MLXD_DASHBOARD.read_text())["templating"]["list"]
                         if v["name"] == "model")["query"]["query"].replace("${prefix}", "vllm")
    for definition in (vllm_variable, mlxd_variable):
        assert label_values(url, definition) == [model], definition
    # The numbers mean what they say.
    # Each load: three requests of n=1 and one of n=2, recorded once each as vLLM does per parent.
    assert query(url, f'vllm:request_params_n_count{{model_name="{model}"}}') == [8.0]
    assert query(url, f'vllm:request_params_n_sum{{model_name="{model}"}}') == [10.0]
    assert query(url, f'process_resident_memory_bytes{{job="mlxd-engine"}}')[0] > 50e6
    # The gateway's own series: six streamed chat requests answered 200, and no stream left open.
    chat = 'handler="/v1/chat/completions",job="mlxd-gateway"'
    assert query(url, f'sum(http_requests_total{{{chat},status="200"}})') == [6.0]
    assert query(url, f'mlxd_gateway_streams_in_flight{{{chat}}}') == [0.0]
    assert query(url, f'count(vllm:num_requests_running{{model_name="{model}"}})') == [1.0]


def test_the_datasource_sets_the_scrape_interval_its_prometheus_config_uses():
    source = yaml.safe_load((ROOT / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    scrape = yaml.safe_load((ROOT / "grafana" / "prometheus.yml").read_text())
    assert source["datasources"][0]["jsonData"]["timeInterval"] == scrape["global"]["scrape_interval"]
    jobs = {c["job_name"] for c in scrape["scrape_configs"]}
    assert jobs == {"mlxd-engine", "mlxd-gateway"}
    # The dashboard names no job: panels follow its model variable, and any job names work.
    assert "job=" not in MLXD_DASHBOARD.read_text()


def test_mlxd_dashboard_reads_no_name_served_only_under_the_vllm_prefix():
    # The live test runs it under vllm:; under the default mlxd: prefix the same names exist,
    # except vLLM's deprecated ones, which only `--metrics-prefix vllm` serves.
    deprecated = json.loads((ROOT / "tests" / "engined" / "vllm_metrics.json").read_text())["deprecated"]
    exprs = " ".join(expr for _, expr in mlxd_panel_queries(".*"))
    assert deprecated and not [name for name in deprecated if f":{name}" in exprs]
