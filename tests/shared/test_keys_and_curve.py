"""App keys are hashed at rest in a 0600 file; private directories; which endpoints need CurveZMQ."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from mlxd.gateway.state import KeyChecker
from mlxd import cli
from mlxd.shared.curve import InsecureEndpointError, check_endpoint, is_loopback, make_keys
from mlxd.shared.errors import MlxdError
from mlxd.shared.keys import add_key, match_key, read_keys, revoke_key
from mlxd.shared.paths import UnsafeDirectoryError, check_ipc_endpoint, check_private_dir


def test_keys_add_list_revoke_through_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert cli.main(["keys", "add", "alpha"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("mlxd_")
    path = tmp_path / "mlxd" / "keys.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert cli.main(["keys", "add", "beta"]) == 0
    capsys.readouterr()
    assert cli.main(["keys", "add", "alpha"]) == 2  # one key per app: revoke first
    assert "revoke" in capsys.readouterr().err
    assert cli.main(["keys", "list"]) == 0
    listed = capsys.readouterr().out
    assert [line.split("\t")[0] for line in listed.splitlines()] == ["alpha", "beta"]
    secret = key.split("_", 2)[2]
    assert secret not in listed and secret not in path.read_text()
    assert cli.main(["keys", "revoke", "alpha"]) == 0
    assert [k.app for k in read_keys(str(path)).keys] == ["beta"]
    assert cli.main(["keys", "revoke", "alpha"]) == 1
    assert cli.main(["keys", "add", "no spaces"]) == 2


def test_a_key_is_stored_as_a_salted_hash_and_matches_only_itself(tmp_path):
    path = str(tmp_path / "keys.json")
    a, b = add_key(path, "a"), add_key(path, "b")
    keys = read_keys(path)
    entry = keys.keys[0]
    secret = a.split("_", 2)[2]
    assert entry.hash == hashlib.sha256(bytes.fromhex(entry.salt) + secret.encode()).hexdigest()
    assert keys.keys[0].salt != keys.keys[1].salt
    assert match_key(keys, a) == "a" and match_key(keys, b) == "b"
    # Another key's id with this key's secret, a changed secret, garbage: no app.
    assert match_key(keys, f"mlxd_{keys.keys[1].key_id}_{secret}") is None
    assert match_key(keys, a[:-2]) is None
    assert match_key(keys, "Bearer") is None and match_key(keys, "") is None


def test_the_gateways_checker_sees_changes_of_the_file(tmp_path):
    path = str(tmp_path / "keys.json")
    checker = KeyChecker(path)
    assert not checker.active  # no file: no app keys required
    key = add_key(path, "a")
    assert checker.active and checker.app_of(key) == "a"
    revoke_key(path, "a")
    assert checker.app_of(key) is None


def test_revoking_the_last_key_or_deleting_the_file_keeps_authentication_on(tmp_path):
    path = str(tmp_path / "keys.json")
    key = add_key(path, "a")
    checker = KeyChecker(path)
    revoke_key(path, "a")
    assert checker.active and checker.app_of(key) is None  # nobody gets in
    os.unlink(path)
    assert checker.active  # this gateway saw keys: still on
    assert KeyChecker(path).active  # a gateway started now: the marker keeps it on
    again = add_key(path, "b")
    assert checker.active and checker.app_of(again) == "b"


def test_a_damaged_key_file_stops_the_start_and_later_shuts_everyone_out_without_paths(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text("{not json")
    with pytest.raises(MlxdError, match="damaged") as err:
        KeyChecker(str(path))
    assert str(path) in err.value.message  # the operator is told which file
    path.unlink()
    key = add_key(str(path), "a")
    checker = KeyChecker(str(path))
    path.write_text('{"keys": 5}')
    with pytest.raises(MlxdError) as err:
        checker.active
    assert err.value.status == 500 and str(tmp_path) not in err.value.message
    assert checker.app_of(key) is None


def test_private_dirs_refuse_other_writers_and_other_owners(tmp_path):
    d = tmp_path / "d"
    check_private_dir(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(d, 0o755)
    check_private_dir(str(d))  # readable only: tightened, not refused
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for mode in (0o777, 0o770, 0o1777):
        os.chmod(d, mode)
        with pytest.raises(UnsafeDirectoryError, match="writable by other users"):
            check_ipc_endpoint(f"ipc://{d}/engine.sock")
    check_ipc_endpoint("tcp://127.0.0.1:5555")
    # A gateway does not create the engine's directory; it checks it only when it is there.
    check_ipc_endpoint(f"ipc://{tmp_path}/absent/engine.sock", create=False)
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize("endpoint, loopback", [
    ("ipc:///tmp/x/engine.sock", True), ("tcp://127.0.0.1:5555", True), ("tcp://127.8.0.1:5555", True),
    ("tcp://localhost:5555", True), ("tcp://[::1]:5555", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://192.168.1.4:5555", False),
    ("tcp://eth0:5555", False), ("tcp://[::]:5555", False), ("tcp://example.com:5555", False),
    ("tcp://127.0.0.1:1;10.0.0.2:5555", False), ("udp://127.0.0.1:5", False),
])
def test_which_endpoints_count_as_loopback(endpoint, loopback):
    assert is_loopback(endpoint) is loopback
    if loopback:
        check_endpoint(endpoint, None)
    else:
        with pytest.raises(InsecureEndpointError, match="mlxd keys curve"):
            check_endpoint(endpoint, None)
    check_endpoint(endpoint, "/some/keys")


def test_curve_keys_are_made_once_with_private_secrets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert cli.main(["keys", "curve"]) == 0
    d = tmp_path / "mlxd" / "curve"
    for name in ("engine", "gateway"):
        assert stat.S_IMODE(os.stat(d / f"{name}.key_secret").st_mode) == 0o600
    assert (d / "authorized" / "gateway.key").read_text() == (d / "gateway.key").read_text()
    before = (d / "engine.key_secret").read_bytes()
    make_keys(str(d))  # again: the keys gateways hold copies of stay
    assert (d / "engine.key_secret").read_bytes() == before


def test_listeners_default_to_loopback():
    from mlxd.shared.serve_config import DaemonConfig, GatewayConfig

    assert GatewayConfig().host == "127.0.0.1" and DaemonConfig().metrics_host == "127.0.0.1"
    assert DaemonConfig().engine_endpoint is None  # the ipc socket in the private runtime dir
