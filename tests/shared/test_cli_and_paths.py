"""CLI flags map 1:1 onto the config Structs; the runtime directory is private."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import msgspec
import pytest

from mlxd import cli
from mlxd.flags import build_config, to_flags
from mlxd.shared.config import EngineConfig
from mlxd.shared.paths import default_engine_endpoint, runtime_dir
from mlxd.shared.serve_config import DaemonConfig, GatewayConfig


def _parse(*argv):
    args = cli.build_parser().parse_args(list(argv))
    cli.take_models(args)
    return args


def test_every_config_field_has_a_flag_with_vllm_style_name():
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for struct in (EngineConfig, DaemonConfig, GatewayConfig):
        for f in msgspec.structs.fields(struct):
            if f.name in cli.SET_BY_SERVE:
                continue
            assert "--" + f.name.replace("_", "-") in help_text


def test_flags_build_configs_and_round_trip_to_the_engine_child():
    args = _parse("serve", "my.gguf", "--max-model-len", "256", "--no-enable-prefix-caching",
                  "--gpu-memory-utilization", "0.5", "--port", "9000", "--api-key", "k",
                  "--allowed-origins", "http://a", "http://b")
    engine = build_config(EngineConfig, args)
    assert engine.model == "my.gguf" and engine.max_model_len == 256
    assert engine.enable_prefix_caching is False and engine.gpu_memory_utilization == 0.5
    gateway = build_config(GatewayConfig, args)
    assert gateway.port == 9000 and gateway.api_key == "k" and gateway.allowed_origins == ["http://a", "http://b"]
    # What `serve` passes to its engine child rebuilds the same config.
    again = build_config(EngineConfig, _parse("engine", *to_flags(engine)))
    assert again == engine


def test_bad_values_are_refused_with_a_message(capsys):
    assert cli.main(["engine", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("gateway", "--port", "eighty")


def test_runtime_dir_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    os.makedirs(tmp_path / "mlxd", mode=0o755)
    os.chmod(tmp_path / "mlxd", 0o755)
    path = runtime_dir()
    assert path == str(tmp_path / "mlxd")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert default_engine_endpoint() == f"ipc://{tmp_path}/mlxd/engine.sock"


def test_an_mlx_without_its_cpu_backend_says_what_to_install(tmp_path):
    # What `pip install mlx` without the [cpu] extra gives on Linux: mlx.core cannot load libmlx.so.
    fake = tmp_path / "mlx"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "core.py").write_text(
        'raise ImportError("libmlx.so: cannot open shared object file: No such file or directory")\n')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "mlxd", "engine", "--engine-endpoint", f"ipc://{tmp_path}/e.sock"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root])})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "pip install 'mlxd[cpu]'" in r.stderr, r.stderr
