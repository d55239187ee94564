"""Where mlxd keeps its files: the engine's socket (runtime) and keys (config), private to the user."""

from __future__ import annotations

import os
import socket
import stat
import tempfile

from mlxd.shared.errors import InvalidRequestError


class UnsafeDirectoryError(InvalidRequestError):
    """A directory that would let other users plant or replace mlxd's sockets or keys."""


def check_private_dir(path: str, create: bool = True) -> str:
    """``path`` as a directory of this user that nobody else can write, created 0700 if missing.

    Anyone who can write the directory of the engine's socket can put their own
    socket in its place and speak for the engine (or read every prompt), so such
    a directory is refused, never silently used. One readable by others is
    tightened to 0700: nothing is lost, and only the owner needs to list it.
    """
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise UnsafeDirectoryError(f"directory {path} belongs to uid {st.st_uid}, not to this user "
                                   f"({os.getuid()}); refusing to use it")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UnsafeDirectoryError(
            f"directory {path} is writable by other users (mode {mode:o}); refusing to use it: "
            f"run `chmod 700 {path}` or choose another directory")
    if mode & 0o077:
        os.chmod(path, 0o700)
    return path


def runtime_dir() -> str:
    """The per-user runtime directory, private (see check_private_dir).

    $XDG_RUNTIME_DIR/mlxd where the OS provides one (already private to the
    user); otherwise mlxd-<uid> under the system temp directory.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        path = os.path.join(base, "mlxd")
    else:
        path = os.path.join(tempfile.gettempdir(), f"mlxd-{os.getuid()}")
    return check_private_dir(path)


def default_engine_endpoint() -> str:
    """The engine's default ZeroMQ endpoint: an ipc socket in the runtime directory."""
    return "ipc://" + os.path.join(runtime_dir(), "engine.sock")


def check_ipc_endpoint(endpoint: str, create: bool = True) -> None:
    """Refuse an ipc endpoint whose socket directory others can write (no-op for other transports)."""
    if endpoint.startswith("ipc://"):
        directory = os.path.dirname(os.path.abspath(endpoint[len("ipc://"):]))
        if create or os.path.isdir(directory):
            check_private_dir(directory, create=create)


def xdg_home(kind: str) -> str:
    """The user's base directory of ``kind`` ("config", "cache"): $XDG_<KIND>_HOME, else ~/.<kind>."""
    return os.environ.get(f"XDG_{kind.upper()}_HOME") or os.path.join(os.path.expanduser("~"), "." + kind)


def config_dir() -> str:
    """$XDG_CONFIG_HOME/mlxd (~/.config/mlxd): keys and certificates; not created here."""
    return os.path.join(xdg_home("config"), "mlxd")


def cache_dir() -> str:
    """$XDG_CACHE_HOME/mlxd (~/.cache/mlxd): what mlxd derives from models; not created here."""
    return os.path.join(xdg_home("cache"), "mlxd")


def refuse_live_ipc(endpoint: str) -> None:
    """Refuse to bind an ipc endpoint whose socket file a live engine is serving.

    ZeroMQ's ipc bind silently replaces an existing socket file, which would cut
    the running engine off from every new gateway.
    """
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://"):]
    if not os.path.exists(path):
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        return  # a stale file left by a dead engine
    finally:
        s.close()
    raise InvalidRequestError(f"another engine is already serving {endpoint}", param="engine_endpoint")
