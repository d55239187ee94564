"""`mlxd service`: launchd agents and systemd user units written into a temporary HOME.

launchctl does not exist here and `systemctl --user` has no session bus in
CI containers, so recording fakes of both stand first on PATH: they log every
call (argv as JSON) and keep which jobs are loaded, as the real tools would.
The unit files themselves are checked by the real `systemd-analyze verify`
where it is installed, and the real systemctl, without a user session here,
shows what a user is told then.
"""

from __future__ import annotations

import json
import os
import plistlib
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from mlxd import cli
from mlxd.flags import build_config
from mlxd.shared.config import EngineConfig
from mlxd.shared.serve_config import DaemonConfig, GatewayConfig

FAKE = """#!{python}
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0]), *argv]) + "\\n")
state = os.environ["FAKE_STATE"]
if os.path.basename(sys.argv[0]) == "launchctl":
    verb = argv[0]
    if verb == "print" and argv[1].count("/") == 1:  # the gui/<uid> domain: a GUI login session
        if os.environ.get("FAKE_NO_GUI"):
            sys.stderr.write("Could not find domain for port identifier: 0x0\\n")
            sys.exit(113)
        sys.exit(0)
    if verb == "print":
        sys.exit(0 if os.path.exists(os.path.join(state, argv[1].rsplit("/", 1)[1])) else 113)
    if verb == "bootstrap":
        label = os.path.basename(argv[2])[: -len(".plist")]
        if os.path.exists(os.path.join(state, label)):
            sys.exit(37)  # launchctl's "service already loaded"
        open(os.path.join(state, label), "w").close()
    if verb == "bootout":
        os.unlink(os.path.join(state, argv[1].rsplit("/", 1)[1]))
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A temporary HOME with fake launchctl/systemctl/journalctl first on PATH; yields (home, calls)."""
    home = tmp_path / "home"
    home.mkdir()
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    log = tmp_path / "calls.jsonl"
    for tool in ("launchctl", "systemctl", "journalctl"):
        path = bin_dir / tool
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_STATE", str(state))

    def calls():
        """The calls made since the last look."""
        if not log.exists():
            return []
        out = [json.loads(line) for line in log.read_text().splitlines()]
        log.unlink()
        return out

    yield home, calls, state


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


INSTALL = ["service", "install", "/models/m.gguf", "--max-model-len", "256", "--port", "9123",
           "--api-key", "s3cret", "--env", "HF_TOKEN=hf_s3cret token"]


def _parse_back(argv):
    """The configs an installed command line would run with (its flags parsed by the real parser)."""
    from mlxd.service.jobs import mlxd_command

    # The installed entry point, not `python -m mlxd`: that would import a ~/shared/ first.
    assert argv[0] == mlxd_command() and os.path.dirname(argv[0]) == os.path.dirname(sys.executable)
    assert "-m" not in argv
    args = cli.build_parser().parse_args(argv[1:])
    cli.take_models(args)
    return args


def _check_env_kept_private(argv, home, unit_files) -> None:
    """--env values reach the process through a 0600 file named by --env-file, never its unit or argv."""
    from mlxd.service.jobs import read_env_file

    args = _parse_back(argv)
    assert read_env_file(args.env_file) == {"HF_TOKEN": "hf_s3cret token"}
    assert stat.S_IMODE(os.stat(args.env_file).st_mode) == 0o600 and args.env_file.startswith(str(home))
    assert not any("hf_s3cret" in word for word in argv)
    for path in unit_files:
        assert "hf_s3cret" not in path.read_text(errors="replace")


def _check_key_kept_private(gw: GatewayConfig, home, unit_files) -> None:
    """--api-key reaches the gateway through a 0600 file, never through its unit or command line."""
    assert gw.api_key is None and gw.api_key_file is not None
    assert open(gw.api_key_file).read() == "s3cret"
    assert stat.S_IMODE(os.stat(gw.api_key_file).st_mode) == 0o600
    assert gw.api_key_file.startswith(str(home))
    for path in unit_files:
        assert "s3cret" not in path.read_text()


def test_launchd_agents_install_idempotently_and_uninstall_leaves_nothing(home, capsys):
    home, calls, state = home
    uid = os.getuid()
    assert cli.main([*INSTALL, "--manager", "launchd"]) == 0
    agents = home / "Library" / "LaunchAgents"
    plists = {}
    for name in ("engine", "gateway"):
        with open(agents / f"local.mlxd.{name}.plist", "rb") as f:
            plists[name] = plistlib.load(f)
    for name, plist in plists.items():
        assert plist["Label"] == f"local.mlxd.{name}"
        assert plist["KeepAlive"] is True and plist["RunAtLoad"] is True and plist["ThrottleInterval"] >= 5
        assert plist["StandardOutPath"] == str(home / "Library" / "Logs" / "mlxd" / f"{name}.log")
        assert plist["StandardErrorPath"] == str(home / "Library" / "Logs" / "mlxd" / f"{name}.err.log")
        assert plist["EnvironmentVariables"]["PYTHONUNBUFFERED"] == "1"
        assert plist["ProgramArguments"][1] == name
        _check_env_kept_private(plist["ProgramArguments"], home,
                                [agents / f"local.mlxd.{n}.plist" for n in ("engine", "gateway")])
    assert (home / "Library" / "Logs" / "mlxd").is_dir()
    # The serve options the user gave, split between the two processes, and one endpoint for both.
    engine = _parse_back(plists["engine"]["ProgramArguments"])
    gateway = _parse_back(plists["gateway"]["ProgramArguments"])
    assert build_config(EngineConfig, engine).model == "/models/m.gguf"
    assert build_config(EngineConfig, engine).max_model_len == 256
    gw = build_config(GatewayConfig, gateway)
    assert gw.port == 9123 and gw.api_key is None
    _check_key_kept_private(gw, home, [agents / f"local.mlxd.{n}.plist" for n in ("engine", "gateway")])
    assert gw.engine_endpoint == build_config(DaemonConfig, engine).engine_endpoint
    assert gw.engine_endpoint.startswith("ipc://") and str(home.parent / "run") in gw.engine_endpoint

    domain = f"gui/{uid}"
    first = calls()
    assert first == [
        ["launchctl", "print", domain],
        ["launchctl", "print", f"{domain}/local.mlxd.engine"],
        ["launchctl", "bootstrap", domain, str(agents / "local.mlxd.engine.plist")],
        ["launchctl", "print", f"{domain}/local.mlxd.gateway"],
        ["launchctl", "bootstrap", domain, str(agents / "local.mlxd.gateway.plist")],
    ]
    before = _files(home)

    # Again, with a changed option: updated in place, the loaded jobs booted out and in again
    # (and, given no --api-key and no --env this time, their files gone).
    assert cli.main([*INSTALL[:-4], "--port", "9124", "--manager", "launchd"]) == 0
    assert _files(home) == [f for f in before if not f.endswith(("service-api-key", "service.env"))]
    with open(agents / "local.mlxd.gateway.plist", "rb") as f:
        argv = plistlib.load(f)["ProgramArguments"]
        assert "9124" in argv and "--env-file" not in argv
    assert calls() == [
        ["launchctl", "print", domain],
        ["launchctl", "print", f"{domain}/local.mlxd.engine"],
        ["launchctl", "bootout", f"{domain}/local.mlxd.engine"],
        ["launchctl", "bootstrap", domain, str(agents / "local.mlxd.engine.plist")],
        ["launchctl", "print", f"{domain}/local.mlxd.gateway"],
        ["launchctl", "bootout", f"{domain}/local.mlxd.gateway"],
        ["launchctl", "bootstrap", domain, str(agents / "local.mlxd.gateway.plist")],
    ]

    assert cli.main(["service", "restart", "--manager", "launchd"]) == 0
    assert [c for c in calls() if c[1] != "print"] == [
        ["launchctl", "kickstart", "-k", f"{domain}/local.mlxd.engine"],
        ["launchctl", "kickstart", "-k", f"{domain}/local.mlxd.gateway"],
    ]
    assert cli.main(["service", "stop", "--manager", "launchd"]) == 0
    assert [c for c in calls() if c[1] != "print"] == [
        ["launchctl", "bootout", f"{domain}/local.mlxd.gateway"],
        ["launchctl", "bootout", f"{domain}/local.mlxd.engine"],
    ]
    assert cli.main(["service", "status", "--manager", "launchd"]) != 0  # nothing loaded
    calls()
    assert cli.main(["service", "start", "--manager", "launchd"]) == 0
    assert [c[1] for c in calls() if c[1] != "print"] == ["bootstrap", "bootstrap"]
    assert cli.main(["service", "status", "--manager", "launchd"]) == 0
    calls()

    (home / "Library" / "Logs" / "mlxd" / "engine.log").write_text("loading\nengine ready\n")
    capsys.readouterr()
    assert cli.main(["service", "logs", "-n", "1", "--manager", "launchd"]) == 0
    out = capsys.readouterr().out
    assert "engine ready" in out and "loading" not in out
    assert cli.main(["service", "uninstall", "--manager", "launchd"]) == 0
    assert calls() == [
        ["launchctl", "print", f"{domain}/local.mlxd.gateway"],
        ["launchctl", "bootout", f"{domain}/local.mlxd.gateway"],
        ["launchctl", "print", f"{domain}/local.mlxd.engine"],
        ["launchctl", "bootout", f"{domain}/local.mlxd.engine"],
    ]
    assert _files(home) == [] and not (home / "Library" / "Logs" / "mlxd").exists()
    assert os.listdir(state) == []
    # Uninstalling what is not there is not an error.
    assert cli.main(["service", "uninstall", "--manager", "launchd"]) == 0


def test_launchd_without_a_gui_session_says_so_in_one_line_and_writes_nothing(home, capsys, monkeypatch):
    home, calls, _ = home
    monkeypatch.setenv("FAKE_NO_GUI", "1")
    for argv in ([*INSTALL, "--manager", "launchd"], ["service", "start", "--manager", "launchd"]):
        capsys.readouterr()
        assert cli.main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mlxd service {argv[1]}: no GUI login session"), err
        assert "Could not find domain" in err[0] and "log in" in err[0]
    assert _files(home) == []
    assert {c[1] for c in calls()} == {"print"}  # nothing bootstrapped


def test_launchd_start_before_install_says_so(home, capsys):
    assert cli.main(["service", "start", "--manager", "launchd"]) == 1
    assert "mlxd service install" in capsys.readouterr().err


def test_systemd_user_units_install_idempotently_and_uninstall_leaves_nothing(home):
    home, calls, _ = home
    assert cli.main([*INSTALL, "--manager", "systemd"]) == 0
    unit_dir = home / ".config" / "systemd" / "user"
    units = ["mlxd-engine.service", "mlxd-gateway.service"]
    texts = {u: (unit_dir / u).read_text() for u in units}
    for unit, text in texts.items():
        lines = text.splitlines()
        assert "Restart=always" in lines and "WantedBy=default.target" in lines
        assert "Environment=PYTHONUNBUFFERED=1" in lines
        exec_start = next(line for line in lines if line.startswith("ExecStart="))[len("ExecStart="):]
        argv = shlex.split(exec_start)
        assert argv[1] == unit.split("-")[1].split(".")[0]
        _check_env_kept_private(argv, home, [unit_dir / u for u in units])
        if unit == "mlxd-gateway.service":
            _check_key_kept_private(build_config(GatewayConfig, _parse_back(argv)), home,
                                    [unit_dir / u for u in units])
    assert "After=network.target mlxd-engine.service" in texts["mlxd-gateway.service"]
    probe = ["systemctl", "--user", "show-environment"]  # is there a user manager to talk to?
    assert calls() == [
        probe,
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", *units],
        ["systemctl", "--user", "restart", *units],
    ]
    before = _files(home)
    assert cli.main([*INSTALL, "--manager", "systemd"]) == 0
    assert _files(home) == before and calls()[-1] == ["systemctl", "--user", "restart", *units]

    for verb in ("start", "stop", "restart"):
        assert cli.main(["service", verb, "--manager", "systemd"]) == 0
    assert calls() == [probe, ["systemctl", "--user", "start", *units],
                       probe, ["systemctl", "--user", "stop", *reversed(units)],
                       probe, ["systemctl", "--user", "restart", *units]]
    assert cli.main(["service", "logs", "-n", "20", "--manager", "systemd"]) == 0
    assert calls() == [["journalctl", "--user", "--no-pager", "-n", "20", "-u", units[0], "-u", units[1]]]

    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 0
    assert calls() == [["systemctl", "--user", "disable", "--now", *units],
                       ["systemctl", "--user", "daemon-reload"]]
    assert _files(home) == []


def test_systemd_set_of_models_installs_an_engine_unit_each_and_a_reinstall_of_one_removes_the_rest(home):
    home, calls, _ = home
    unit_dir = home / ".config" / "systemd" / "user"
    assert cli.main(["service", "install", "/models/a.gguf", "/models/b.gguf", "--port", "9123",
                     "--manager", "systemd"]) == 0
    units = ["mlxd-engine-0.service", "mlxd-engine-1.service", "mlxd-gateway.service"]
    assert sorted(p.name for p in unit_dir.iterdir()) == units
    assert calls()[-1] == ["systemctl", "--user", "restart", *units]
    gateway = (unit_dir / units[2]).read_text()
    assert "After=network.target mlxd-engine-0.service mlxd-engine-1.service" in gateway
    argv = shlex.split(next(line for line in gateway.splitlines() if line.startswith("ExecStart="))[10:])
    endpoints = build_config(GatewayConfig, _parse_back(argv)).engines
    assert [n for n, _ in endpoints] == ["a", "b"] and endpoints[0][1] != endpoints[1][1]
    for n, (name, endpoint) in enumerate(endpoints):
        engine = shlex.split(next(line for line in (unit_dir / units[n]).read_text().splitlines()
                                  if line.startswith("ExecStart="))[10:])
        assert f"/models/{name}.gguf" in engine and endpoint in engine and name in engine

    assert cli.main([*INSTALL, "--manager", "systemd"]) == 0
    assert sorted(p.name for p in unit_dir.iterdir()) == ["mlxd-engine.service", "mlxd-gateway.service"]
    assert ["systemctl", "--user", "disable", "--now", *units[:2]] in calls()
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 0
    assert not unit_dir.exists() or list(unit_dir.iterdir()) == []


def test_systemd_quoting_survives_specifiers_and_quotes():
    from mlxd.service.systemd import _quote

    assert _quote("--max-model-len") == "--max-model-len"
    assert _quote("50%") == "50%%" and _quote("$HOME") == '"$$HOME"'
    assert _quote("A=$HOME", command=False) == '"A=$HOME"'
    assert shlex.split(_quote('a "b" c\\d')) == ['a "b" c\\d']


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    from mlxd.service.jobs import Job, mlxd_command, service_env
    from mlxd.service.systemd import SystemdManager

    manager = SystemdManager(str(tmp_path))
    env = {**service_env(), "NOTE": "50% of $HOME"}  # a passed path may hold either
    for name in ("engine", "gateway"):
        path = tmp_path / f"mlxd-{name}.service"
        path.write_bytes(manager.render(Job(name, [mlxd_command(), name, "--port", "1"], env)))
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
        # Only complaints about this unit count; the container's own units may be incomplete.
        bad = [line for line in (r.stdout + r.stderr).splitlines() if f"mlxd-{name}" in line]
        assert bad == [], bad


def _no_user_session() -> bool:
    if shutil.which("systemctl") is None:
        return False
    return subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True).returncode != 0


@pytest.mark.skipif(not _no_user_session(), reason="needs the real systemctl and no systemd user session")
def test_without_a_user_session_every_verb_says_so_in_one_line_with_the_fix(tmp_path, monkeypatch, capsys):
    # The real systemctl (no fakes on PATH), on a machine with no user manager, as in a container.
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    for argv in ([*INSTALL, "--manager", "systemd"], *(["service", verb, "--manager", "systemd"]
                                                       for verb in ("start", "stop", "restart", "status"))):
        capsys.readouterr()
        assert cli.main(argv) == 1
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and captured.out == "", (argv, captured)
        assert err[0].startswith(f"mlxd service {argv[1]}: no systemd user session")
        assert "loginctl enable-linger" in err[0] and "Failed to connect to bus" in err[0]
    assert _files(home) == []  # the refused install wrote nothing, the API key file neither


@pytest.mark.skipif(not _no_user_session(), reason="needs the real systemctl and no systemd user session")
def test_uninstall_reports_a_failed_disable_and_still_removes_the_units(tmp_path, monkeypatch, capsys):
    from mlxd.service.systemd import SystemdManager

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    manager = SystemdManager()
    for name in ("engine", "gateway"):  # left by an install made while a session was there
        manager.unit_path(name).parent.mkdir(parents=True, exist_ok=True)
        manager.unit_path(name).write_text("[Service]\nExecStart=/bin/true\n")
    capsys.readouterr()
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 1
    err = capsys.readouterr().err
    assert "`systemctl --user disable --now` failed (Failed to connect to bus" in err
    assert "with the problems above" in err
    assert _files(home) == []



def test_env_file_sets_the_processes_environment_and_a_missing_one_is_one_line(tmp_path, monkeypatch):
    import argparse

    from mlxd.processes import _load_env_file
    from mlxd.service.jobs import env_items, format_env_file

    path = tmp_path / "service.env"
    path.write_bytes(format_env_file(env_items(["MLXD_TEST_TOKEN=a=b c", "MLXD_TEST_EMPTY="])))
    monkeypatch.delenv("MLXD_TEST_TOKEN", raising=False)
    monkeypatch.delenv("MLXD_TEST_EMPTY", raising=False)
    _load_env_file(argparse.Namespace(env_file=str(path)))
    assert os.environ["MLXD_TEST_TOKEN"] == "a=b c" and os.environ["MLXD_TEST_EMPTY"] == ""
    with pytest.raises(ValueError, match="one line"):
        env_items(["A=two\nlines"])
    r = subprocess.run([sys.executable, "-m", "mlxd", "gateway", "--env-file", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"mlxd: --env-file {tmp_path / 'nope'}: No such file or directory"]
