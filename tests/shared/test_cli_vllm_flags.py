"""The CLI an operator meets: help for every flag, vLLM's size suffixes and no-op flags, one-line errors."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest

from mlxd import cli, vllm_compat
from mlxd.flags import build_config, to_flags
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.serve_config import GatewayConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sub(*path):
    parser = cli.build_parser()
    for name in path:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def _mlxd(*argv, timeout=60):
    return subprocess.run([sys.executable, "-m", "mlxd", *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ROOT})


def test_every_serve_flag_says_its_default_and_closed_sets_list_their_choices():
    serve = _sub("serve")
    for action in serve._actions:
        if action.help == argparse.SUPPRESS or action.dest in ("help", "model_pos"):
            continue
        assert action.help and "default" in action.help, action.option_strings
    text = serve.format_help()
    for shown in ("{auto,float32,float16,bfloat16,quantized}", "{mlxd,vllm}", "{DEBUG,INFO,WARNING,ERROR}",
                  "CPU, 8192 on a GPU)", "(default: on)", "(default: 8000)"):
        assert shown in text


@pytest.mark.parametrize("verb", ["start", "stop", "restart", "status", "install", "uninstall", "logs"])
def test_service_verbs_describe_themselves(verb):
    assert _sub("service", verb).description


@pytest.mark.parametrize("text,tokens", [("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("4096", 4096),
                                         ("1m", 1000000)])
def test_sizes_parse_as_vllms_human_readable_int(text, tokens):
    args = cli.build_parser().parse_args(["serve", "--max-model-len", text])
    assert build_config(EngineConfig, args).max_model_len == tokens


def test_decimals_with_a_binary_suffix_are_refused():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--max-model-len", "1.5K"])


def test_an_empty_allowed_origins_is_not_written_into_the_gateway_command():
    assert "--allowed-origins" not in to_flags(GatewayConfig())
    assert to_flags(GatewayConfig(allowed_origins=["http://a"]))[-2:] == ["--allowed-origins", "http://a"]


def test_a_bad_log_level_is_one_line():
    r = _mlxd("serve", "--log-level", "foo")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--log-level" in r.stderr and "'foo'" in r.stderr.lower(), r.stderr


def test_vllm_flags_with_no_effect_warn_and_ones_that_would_change_behaviour_are_refused():
    args = cli.build_parser().parse_args(
        ["serve", "--tensor-parallel-size", "1", "--trust-remote-code", "--enable-chunked-prefill",
         "--download-dir", "/tmp/x", "--disable-log-requests", "--disable-log-stats", "--dtype", "auto"])
    warnings = vllm_compat.check(args)
    # --tensor-parallel-size is mlxd's own flag (engined/parallel/pipeline.py): no warning.
    assert len(warnings) == 3 and all(w.count("\n") == 0 and "no effect" in w for w in warnings), warnings
    assert build_config(GatewayConfig, args).enable_log_requests is False
    for bad in (["-dp", "2"], ["--no-enable-chunked-prefill"], ["--kv-cache-dtype", "fp8"]):
        with pytest.raises(InvalidRequestError) as e:
            vllm_compat.check(cli.build_parser().parse_args(["serve", *bad]))
        assert "not supported" in e.value.message


def _busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_a_copied_vllm_line_on_a_busy_port_warns_then_fails_in_one_line_before_any_load(tmp_path):
    s, port = _busy_port()
    with s:
        r = _mlxd("serve", "--enable-chunked-prefill", "--trust-remote-code", "--port", str(port),
                  "--engine-endpoint", f"ipc://{tmp_path}/e.sock")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 3, r.stderr  # two warnings, one error
    assert lines[-1] == (f"mlxd: --port {port} on 127.0.0.1 is in use by another process (another mlxd or "
                         f"vLLM?); stop that process or pick another --port")
    assert "loading" not in r.stderr and "Traceback" not in r.stderr


def test_a_busy_metrics_port_is_found_before_the_engine_loads(tmp_path):
    s, port = _busy_port()
    with s:
        r = _mlxd("engine", "--metrics-port", str(port), "--engine-endpoint", f"ipc://{tmp_path}/e.sock")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"mlxd: --metrics-port {port} on 127.0.0.1 is in use by another process (another mlxd or vLLM?); "
        "stop that process or pick another --metrics-port"], r.stderr


def test_settings_left_to_the_device_follow_it_and_flags_given_override_them():
    """Async scheduling and the encode thread: on for CUDA, the thread off for Metal (unmeasured there), both
    off on the CPU; ``--no-encode-thread`` holds on CUDA too."""
    left = build_config(EngineConfig, _sub("serve").parse_args([]))
    assert left.async_scheduling is None and left.encode_thread is None
    got = {kind: left.for_device(kind) for kind in ("cpu", "metal", "cuda")}
    assert [(c.async_scheduling, c.encode_thread) for c in got.values()] == [(False, False), (True, False),
                                                                               (True, True)]
    assert got["cpu"].max_num_batched_tokens == 1024 and got["cuda"].max_num_batched_tokens == 8192
    off = build_config(EngineConfig, _sub("serve").parse_args(["--no-encode-thread"])).for_device("cuda")
    assert off.encode_thread is False and off.async_scheduling is True
