"""Admission and observability against real processes: the queue cap answers 429, histograms match the client's clocks, memory stays flat."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.servers import Engine, Gateway, free_port


def scrape(port: int) -> dict[tuple, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                           if k not in ("model_name", "engine"))))] = s.value
    return out


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """One running sequence, two waiting places: the third concurrent request is refused."""
    logs = tmp_path_factory.mktemp("admission")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    metrics = free_port()
    engine = Engine(endpoint, str(logs / "engine.log"),
                    extra=["--max-num-seqs", "1", "--max-waiting-requests", "2", "--metrics-port", str(metrics)]).start()
    gateway = Gateway(endpoint, str(logs / "gateway.log")).start()
    gateway.wait_healthy()
    yield gateway, metrics
    gateway.stop()
    engine.stop()


def test_past_the_waiting_cap_clients_get_429_and_admitted_requests_complete(tight):
    gateway, _ = tight
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def one(i):
        try:
            r = client.completions.create(model=model, prompt=f"Count slowly to {i}:", max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens
        except openai.RateLimitError as e:
            assert e.response.headers.get("retry-after") == "1"
            assert e.body["code"] == "overloaded"
            return "429"

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    refused = results.count("429")
    assert refused >= 1, results
    assert all(r == 24 for r in results if r != "429"), results  # everything admitted completed
    assert len(results) - refused >= 3  # one running + two waiting at least


def test_ttft_and_e2e_histograms_agree_with_the_client(client, model, engine, metrics_port):
    before = scrape(metrics_port)
    client_ttft, client_e2e = [], []
    for i in range(4):
        start = time.perf_counter()
        first = None
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Tell me about {i} cats."}],
            max_tokens=12, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
        client_ttft.append(first - start)
        client_e2e.append(time.perf_counter() - start)
    after = scrape(metrics_port)

    def delta(name):
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert delta("mlxd:time_to_first_token_seconds_count") == 4
    assert delta("mlxd:e2e_request_latency_seconds_count") == 4
    ttft, e2e = delta("mlxd:time_to_first_token_seconds_sum"), delta("mlxd:e2e_request_latency_seconds_sum")
    print(f"TTFT sum: engine {ttft:.3f}s, client {sum(client_ttft):.3f}s; "
          f"E2E sum: engine {e2e:.3f}s, client {sum(client_e2e):.3f}s")
    # The engine's clock starts when the request reaches it and stops when its
    # last token leaves; the client's adds HTTP, tokenization and the wire.
    assert 0 < ttft <= sum(client_ttft)
    assert sum(client_ttft) - ttft < 0.25 * 4 + 0.5 * sum(client_ttft)
    assert 0 < e2e <= sum(client_e2e)
    assert sum(client_e2e) - e2e < 0.25 * 4 + 0.2 * sum(client_e2e)


def test_memory_stays_flat_under_64_concurrent_long_requests(client, model, metrics_port):
    def mem():
        m = scrape(metrics_port)
        return m[("mlxd:mlx_active_memory_bytes", ())], m[("process_resident_memory_bytes", ())]

    patient = client.with_options(timeout=900)  # 64 long requests queue behind 16 running ones

    def long_request(i):
        r = patient.completions.create(model=model, prompt=f"Write a long story number {i} about the sea.",
                                      max_tokens=24, temperature=0.7, seed=i, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    def burst():
        with cf.ThreadPoolExecutor(64) as pool:
            assert list(pool.map(long_request, range(64))) == [24] * 64

    # The first burst warms its paths and grows the KV pool to what this load needs (it is
    # resident in proportion to demand, within its planned capacity); the same load again
    # must then find memory where it left it.
    burst()
    active0, rss0 = mem()
    burst()
    active1, rss1 = mem()
    print(f"MLX active memory: {active0 / 2**20:.1f} MiB after a first burst, {active1 / 2**20:.1f} MiB after a "
          f"second of 64 concurrent requests; RSS: {rss0 / 2**20:.1f} MiB -> {rss1 / 2**20:.1f} MiB")
    assert abs(active1 - active0) < 0.05 * active0
    assert abs(rss1 - rss0) < 0.05 * rss0
