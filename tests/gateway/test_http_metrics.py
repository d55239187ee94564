"""The gateway's /metrics counts every HTTP request by route template and status, whatever its fate."""

from __future__ import annotations

import socket

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from mlxd.gateway.server import build_app
from mlxd.shared.serve_config import GatewayConfig


def _unused_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _samples(text: str, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def test_requests_are_counted_by_route_template_and_status_and_unknown_paths_share_one_label():
    # No engine listens: the routes answer 503/4xx, and each answer is counted all the same.
    app = build_app(GatewayConfig(engine_endpoint=_unused_endpoint()))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert client.get("/health").status_code == 503
        for path in ("/no/such/path", "/another/made/up/one"):
            assert client.get(path).status_code == 404
        assert client.get("/v1/chat/completions").status_code == 405
        assert client.post("/v1/chat/completions", content=b"{not json",
                           headers={"content-type": "application/json"}).status_code == 400
        assert client.get("/v1/models/org/some-model").status_code in (401, 404, 503)
        r = client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
    counts = _samples(text, "http_requests_total")
    by = {(dict(k)["handler"], dict(k)["method"], dict(k)["status"]): v for k, v in counts.items()}
    assert by[("/health", "GET", "503")] == 1
    assert by[("none", "GET", "404")] == 2  # made-up paths never become series of their own
    assert by[("/v1/chat/completions", "GET", "405")] == 1
    assert by[("/v1/chat/completions", "POST", "400")] == 1
    assert any(h == "/v1/models/{model:path}" for h, _, _ in by)
    durations = _samples(text, "http_request_duration_seconds_count")
    assert sum(durations.values()) == sum(counts.values()) == 6
    # Nothing is in progress once every answer was sent (the scrape itself is counted after it).
    assert all(v in (0, 1) for v in _samples(text, "http_requests_inprogress").values())
    assert sum(_samples(text, "http_requests_inprogress").values()) == 1  # this /metrics request


def test_each_app_has_its_own_registry():
    a = build_app(GatewayConfig(engine_endpoint=_unused_endpoint()))
    b = build_app(GatewayConfig(engine_endpoint=_unused_endpoint()))
    with TestClient(a, base_url="http://127.0.0.1") as client:
        client.get("/health")
    assert _samples(b.state.metrics.exposition().decode(), "http_requests_total") == {}


def test_scrapes_of_metrics_stay_out_of_the_access_log_at_info(caplog):
    import logging

    from mlxd.gateway.access_log import AccessLog

    app = build_app(GatewayConfig(engine_endpoint=_unused_endpoint()))
    with caplog.at_level(logging.DEBUG, logger="mlxd.access"), \
            TestClient(AccessLog(app), base_url="http://127.0.0.1") as client:
        client.get("/metrics")
        client.get("/health")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "mlxd.access"]
    assert [level for level, m in lines if " GET /metrics " in m] == [logging.DEBUG]
    assert [level for level, m in lines if " GET /health " in m] == [logging.INFO]
