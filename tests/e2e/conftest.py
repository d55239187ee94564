"""One engine and one gateway for the whole e2e session (loading the model costs seconds)."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.servers import Engine, Gateway, free_port


@pytest.fixture(scope="session")
def engine_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def engine(engine_endpoint, metrics_port, tmp_path_factory):
    e = Engine(engine_endpoint, str(tmp_path_factory.mktemp("logs") / "engine.log"),
               extra=["--metrics-port", str(metrics_port)]).start()
    yield e
    e.stop()


@pytest.fixture(scope="session")
def gateway(engine, tmp_path_factory):
    g = Gateway(engine.endpoint, str(tmp_path_factory.mktemp("logs") / "gateway.log")).start()
    g.wait_healthy()
    yield g
    g.stop()


@pytest.fixture(scope="session")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model(client) -> str:
    return client.models.list().data[0].id
