"""Per-app API keys: the key file that `mlxd keys add|list|revoke` writes and the gateway checks.

A key reads ``mlxd_<id>_<secret>``. The file keeps, per app, the key's id, a
random salt and sha256(salt + secret); never the secret. The id finds the
entry, so checking a key costs one hash whatever the number of apps. The
secrets are 256 random bits, not passwords: a slow hash (scrypt) would buy
nothing against guessing and would cost every request its time.

The file is written whole to a temporary file of mode 0600 and renamed over
the old one, so a gateway reading it never sees half a file; gateways reload
it when its modification time or size changes (``gateway.state.KeyChecker``),
so a revoked key stops working at once, without a restart.

An app's key may name the LoRA adapters it may use (``mlxd keys add APP
--loras A B``, changed later with ``mlxd keys loras APP ...``): for it the
gateway answers any other adapter as a model that does not exist (404, as
OpenAI answers a model a key has no access to) and ``/v1/models`` lists only
those; the base model is always its to use. A key naming none may use every
adapter.

Once an app has had a key, authentication stays on: revoking the last key
leaves an empty file (nobody gets in without ``--api-key`` until a key is
added), and a marker beside the file (``keys.json.required``) keeps it on when
the file itself is deleted. A damaged file stops a gateway from starting and,
if it is damaged later, shuts everyone out (the path only in the server log).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import tempfile
import time

import msgspec

from mlxd.shared.errors import InvalidRequestError, MlxdError
from mlxd.shared.paths import config_dir

# Short and plain: app names become metric labels and log fields.
_APP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PREFIX = "mlxd"


class AppKey(msgspec.Struct, kw_only=True):
    app: str
    key_id: str
    salt: str  # hex
    hash: str  # hex sha256(salt bytes + secret)
    created: float
    # The LoRA adapters the app may use; None: every one (the base model is always allowed).
    loras: list[str] | None = None


class KeyFile(msgspec.Struct, kw_only=True):
    version: int = 1
    keys: list[AppKey] = []


def default_keys_file() -> str:
    return os.path.join(config_dir(), "keys.json")


def required_marker(path: str) -> str:
    """The file whose presence says that keys are required even with ``path`` empty or gone."""
    return path + ".required"


def _digest(salt: bytes, secret: str) -> str:
    return hashlib.sha256(salt + secret.encode()).hexdigest()


def check_app_name(name: str) -> str:
    if not _APP_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"app name {name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
            param="app")
    return name


def read_keys(path: str) -> KeyFile:
    """The key file's contents; an empty KeyFile when there is none."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return KeyFile()
    try:
        return msgspec.json.decode(data, type=KeyFile)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MlxdError(f"key file {path} is damaged ({e}); fix it, or add a key again "
                        f"with `mlxd keys add` after removing it") from e


def _write_keys(path: str, keys: KeyFile) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    # mkstemp creates the file 0600, so the hashes are never readable by others, not even briefly.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".keys-", suffix=".json")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(keys)))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def add_key(path: str, app: str, loras: list[str] | None = None) -> str:
    """Create the key of ``app`` (limited to the adapters ``loras``, None: any) and return it; the only
    time the secret is seen."""
    check_app_name(app)
    loras = _check_loras(loras)
    keys = read_keys(path)
    if any(k.app == app for k in keys.keys):
        raise InvalidRequestError(f"app {app!r} has a key already; revoke it first to make a new one",
                                  param="app")
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    keys.keys.append(AppKey(app=app, key_id=key_id, salt=salt.hex(), hash=_digest(salt, secret),
                            created=time.time(), loras=loras))
    _write_keys(path, keys)
    # Made after the file: a crash in between leaves a key file, which requires keys on its own.
    fd = os.open(required_marker(path), os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    return f"{_PREFIX}_{key_id}_{secret}"


def revoke_key(path: str, app: str) -> bool:
    """Remove the key of ``app``; False when it had none."""
    keys = read_keys(path)
    kept = [k for k in keys.keys if k.app != app]
    if len(kept) == len(keys.keys):
        return False
    keys.keys = kept
    _write_keys(path, keys)
    return True


def _check_loras(loras: list[str] | None) -> list[str] | None:
    if loras is None:
        return None
    if any(not name for name in loras):
        raise InvalidRequestError("an adapter name cannot be empty", param="loras")
    return sorted(set(loras))


def set_loras(path: str, app: str, loras: list[str] | None) -> bool:
    """Limit ``app``'s key to the adapters ``loras`` (None: any); False when it has no key. Gateways
    see it at their next request, as they see a revoked key."""
    loras = _check_loras(loras)
    keys = read_keys(path)
    entry = next((k for k in keys.keys if k.app == app), None)
    if entry is None:
        return False
    entry.loras = loras
    _write_keys(path, keys)
    return True


def match_key(keys: KeyFile, presented: str) -> str | None:
    """The app whose key ``presented`` is, or None."""
    prefix, _, rest = presented.partition("_")
    key_id, _, secret = rest.partition("_")
    if prefix != _PREFIX or not secret:
        return None
    for k in keys.keys:
        if k.key_id == key_id:
            if hmac.compare_digest(_digest(bytes.fromhex(k.salt), secret), k.hash):
                return k.app
            return None
    return None
