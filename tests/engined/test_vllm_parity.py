"""mlxd's exposition under --metrics-prefix vllm against vLLM's own table (tests/engined/vllm_metrics.json):
every name both serve has vLLM's type, label set and buckets."""

from __future__ import annotations

import json
import pathlib

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.engined.metrics import build_1_2_5_buckets
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import make_tiny_model

TABLE = json.loads((pathlib.Path(__file__).parent / "vllm_metrics.json").read_text())
VLLM = {**TABLE["metrics"], **TABLE["deprecated"]}
# What the issue asks mlxd to serve under vLLM's names (beyond what it served before).
REQUIRED = {
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
    "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
    "request_inference_time_seconds", "request_time_per_output_token_seconds", "cache_config_info",
    "time_per_output_token_seconds", "gpu_cache_usage_perc", "gpu_prefix_cache_queries", "gpu_prefix_cache_hits",
}
SPEC = {n for n, m in VLLM.items() if m.get("when") == "speculative_config is set"}
MAX_MODEL_LEN = 256


def _engine(tmp_path, prefix="vllm", **kw):
    d = make_tiny_model(tmp_path / "m", "llama", seed=11)
    e = Engine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, metrics_prefix=prefix,
                            served_model_name="tiny", max_model_len=MAX_MODEL_LEN, **kw), loaded=load_model(str(d)))
    return e  # the Engine attached its metrics itself: nothing else to call before a scrape


def _families(engine, prefix="vllm"):
    text = generate_latest(engine.metrics.registry).decode()
    return {f.name.split(":", 1)[1]: f for f in text_string_to_metric_families(text) if f.name.startswith(prefix + ":")}


def _labels(family) -> set[str]:
    return {k for s in family.samples for k in s.labels if k != "le"}


def _value(families, name, sample_suffix="", **labels):
    for s in families[name].samples:
        if s.name.endswith(name + sample_suffix) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(name + sample_suffix)


def test_every_shared_name_has_vllms_type_labels_and_buckets(tmp_path):
    e = _engine(tmp_path)
    e.generate([list(range(1, 40)), list(range(1, 41))],
               SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    fams = _families(e)
    missing = REQUIRED - set(fams)
    assert not missing, missing
    shared = set(fams) & set(VLLM)
    print("shared with vLLM:", len(shared), "mlxd only:", sorted(set(fams) - set(VLLM)))
    for name in sorted(shared):
        want, fam = VLLM[name], fams[name]
        assert fam.type == want["type"], name
        if isinstance(want["labels"], list):
            assert _labels(fam) == set(want["labels"]), (name, _labels(fam))
        else:
            assert "engine" in _labels(fam), name
        if want["type"] == "histogram":
            buckets = want["buckets"]
            if buckets == "1-2-5 up to max_model_len":
                buckets = build_1_2_5_buckets(MAX_MODEL_LEN)
            got = [float(s.labels["le"]) for s in fam.samples
                   if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
            assert got == [float(b) for b in buckets], name
    # Not under vLLM's names without speculation, as in vLLM.
    assert not SPEC & set(fams)
    # The new series carry the work done.
    assert _value(fams, "request_prompt_tokens", "_sum") == 39 + 40
    assert _value(fams, "request_generation_tokens", "_sum") == 10
    assert _value(fams, "request_params_max_tokens", "_sum") == 10
    assert _value(fams, "request_inference_time_seconds", "_count") == 2
    assert _value(fams, "request_time_per_output_token_seconds", "_count") == 2
    assert _value(fams, "time_per_output_token_seconds", "_count") == _value(fams, "inter_token_latency_seconds",
                                                                               "_count") == 8
    assert _value(fams, "gpu_prefix_cache_queries", "_total") == _value(fams, "prefix_cache_queries", "_total") == 79
    assert _value(fams, "request_success", "_total", engine="0", model_name="tiny", finished_reason="length") == 2


def test_kv_gauges_and_cache_config_are_set_before_the_first_request(tmp_path):
    e = _engine(tmp_path)
    fams = _families(e)
    info = next(s for s in fams["cache_config_info"].samples)
    assert info.value == 1 and info.labels["num_gpu_blocks"] == "64" and info.labels["engine"] == "0"
    assert info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert _value(fams, "kv_cache_blocks_total") == 64
    assert _value(fams, "kv_cache_blocks_free") == 64
    assert _value(fams, "num_requests_running") == 0


def test_request_params_n_records_the_client_requests_n_once_per_prompt(tmp_path):
    e = _engine(tmp_path)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # One prompt with n=3 (the gateway sends n on choice 0, 0 on the others), and one with n=1.
    for i, n in enumerate((3, 0, 0, 1)):
        e.add_request(f"r{i}", [1, 2, 3, 4], params, params_n=n)
    while e.has_unfinished():
        e.step()
    fams = _families(e)
    assert _value(fams, "request_params_n", "_count") == 2
    assert _value(fams, "request_params_n", "_sum") == 4
    assert _value(fams, "request_params_n", "_bucket", le="2.0") == 1  # the n=1 prompt; n=3 lies above 2


def test_prompt_tokens_count_when_prefill_ends_and_never_for_requests_aborted_before(tmp_path):
    e = _engine(tmp_path, prefix="mlxd")
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    e.add_request("gone", list(range(1, 30)), params)
    e.abort(["gone"])
    e.step()
    e.add_request("live", list(range(1, 20)), params)
    while not _families(e, "mlxd")["generation_tokens"].samples[0].value:
        e.step()
    fams = _families(e, "mlxd")
    assert _value(fams, "prompt_tokens", "_total") == 19  # prefilled, not finished; the aborted one adds none
    assert _value(fams, "request_success", "_total", finished_reason="abort") == 1
    e.abort(["live"])
    e.step()
    assert _value(_families(e, "mlxd"), "prompt_tokens", "_total") == 19


@pytest.mark.parametrize("prefix", ["mlxd", "vllm"])
def test_spec_decode_series_exist_exactly_when_speculating(tmp_path, prefix):
    e = _engine(tmp_path, prefix=prefix, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    fams = _families(e, prefix)
    assert {"spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"} <= set(fams)
    for name in SPEC & set(fams):
        assert fams[name].type == "counter" and _labels(fams[name]) <= set(VLLM[name]["labels"]), name
    deprecated = {"gpu_cache_usage_perc", "time_per_output_token_seconds"} & set(fams)
    assert bool(deprecated) == (prefix == "vllm")
