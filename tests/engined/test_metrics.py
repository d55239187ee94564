"""Engine metrics carry vLLM's names and labels and move with the work done."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import make_tiny_model

VLLM_NAMES = {
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "iteration_tokens_total",
}


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families, name, **labels):
    for fam in families.values():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


@pytest.mark.parametrize("prefix", ["mlxd", "vllm"])
def test_metrics_endpoint_serves_vllm_names_that_move_with_work(prefix, tmp_path):
    d = make_tiny_model(tmp_path / "m", "llama", seed=5)
    e = Engine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, metrics_prefix=prefix,
                            served_model_name="tiny"), loaded=load_model(str(d)))
    server, thread = e.metrics.serve(0)
    try:
        port = server.server_port
        prompt = list(range(1, 40))
        outs = e.generate([prompt, prompt + [7]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        fams = scrape(port)
        names = {n.split(":", 1)[1] for n in fams if n.startswith(prefix + ":")}
        assert VLLM_NAMES <= names
        m = lambda n: f"{prefix}:{n}"  # noqa: E731
        assert value(fams, m("generation_tokens_total"), model_name="tiny") == sum(map(len, outs)) == 10
        assert value(fams, m("prompt_tokens_total"), model_name="tiny") == 39 + 40
        assert value(fams, m("request_success_total"), model_name="tiny", finished_reason="length") == 2
        assert value(fams, m("time_to_first_token_seconds_count"), model_name="tiny") == 2
        assert value(fams, m("inter_token_latency_seconds_count"), model_name="tiny") == 8
        assert value(fams, m("num_requests_running"), model_name="tiny") == 0
        assert value(fams, m("kv_cache_usage_perc"), model_name="tiny") == 0.0
        assert value(fams, m("prefix_cache_queries_total"), model_name="tiny") == 79
        assert value(fams, "process_resident_memory_bytes") > 0
        # A request mid-flight shows up in the gauges.
        e.add_request("live", prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        e.step()
        fams = scrape(port)
        assert value(fams, m("num_requests_running"), model_name="tiny") == 1
        assert value(fams, m("kv_cache_usage_perc"), model_name="tiny") > 0.0
        e.abort(["live"])
        e.step()
        fams = scrape(port)
        assert value(fams, m("request_success_total"), model_name="tiny", finished_reason="abort") == 1
    finally:
        server.shutdown()


def test_per_app_metrics_have_bounded_cardinality(tmp_path):
    from mlxd.engined.metrics import MAX_APP_LABELS

    d = make_tiny_model(tmp_path / "m", "llama", seed=6)
    e = Engine(EngineConfig(num_kv_blocks=128, max_num_batched_tokens=64, served_model_name="tiny"),
               loaded=load_model(str(d)))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(MAX_APP_LABELS + 5):
        e.add_request(f"r{i}", [1, 2, 3], params, app=f"app{i}")
    while e.has_unfinished():
        e.step()
    from prometheus_client import generate_latest

    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(e.metrics.registry).decode())}
    apps = {s.labels["app"] for s in fams["mlxd:app_requests"].samples if s.name.endswith("_total")}
    assert len(apps) == MAX_APP_LABELS + 1 and "other" in apps
    total = sum(s.value for s in fams["mlxd:app_requests"].samples if s.name.endswith("_total"))
    assert total == MAX_APP_LABELS + 5
