"""Per-app API keys: `mlxd keys add|list|revoke`, checked by the gateway.

A key reads ``mlxd_<id>_<secret>``. The file keeps, per app, the key's id, a
random salt and sha256(salt + secret); never the secret. The id finds the
entry, so checking a key costs one hash whatever the number of apps. The
secrets are 256 random bits, not passwords: a slow hash (scrypt) would buy
nothing against guessing and would cost every request its time.

The file is written whole to a temporary file of mode 0600 and renamed over
the old one, so a gateway reading it never sees half a file; gateways reload
it when its modification time or size changes, so a revoked key stops working
at once, without a restart.
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

from shared.errors import InvalidRequestError
from shared.paths import config_dir

# Short and plain: app names become metric labels and log fields.
_APP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PREFIX = "mlxd"


class AppKey(msgspec.Struct, kw_only=True):
    app: str
    key_id: str
    salt: str  # hex
    hash: str  # hex sha256(salt bytes + secret)
    created: float


class KeyFile(msgspec.Struct, kw_only=True):
    version: int = 1
    keys: list[AppKey] = []


def default_keys_file() -> str:
    return os.path.join(config_dir(), "keys.json")


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
        raise InvalidRequestError(f"key file {path} is damaged: {e}") from e


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


def add_key(path: str, app: str) -> str:
    """Create the key of ``app`` and return it; the only time the secret is seen."""
    check_app_name(app)
    keys = read_keys(path)
    if any(k.app == app for k in keys.keys):
        raise InvalidRequestError(f"app {app!r} has a key already; revoke it first to make a new one",
                                  param="app")
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    keys.keys.append(AppKey(app=app, key_id=key_id, salt=salt.hex(), hash=_digest(salt, secret),
                            created=time.time()))
    _write_keys(path, keys)
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


class KeyChecker:
    """The gateway's view of the key file, reloaded whenever the file changes."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple | None = None
        self._keys = KeyFile()

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            self._keys = read_keys(self.path) if stamp is not None else KeyFile()
            self._stamp = stamp

    @property
    def active(self) -> bool:
        """Whether any app has a key (then every request must present one)."""
        self._refresh()
        return bool(self._keys.keys)

    def app_of(self, presented: str) -> str | None:
        self._refresh()
        return match_key(self._keys, presented)
