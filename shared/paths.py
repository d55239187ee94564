"""Where mlxd keeps its runtime files (the engine's socket), private to the user."""

from __future__ import annotations

import os
import tempfile


def runtime_dir() -> str:
    """The per-user runtime directory, created mode 0700 (and made 0700 if it exists).

    $XDG_RUNTIME_DIR/mlxd where the OS provides one (already private to the
    user); otherwise mlxd-<uid> under the system temp directory. An existing
    directory owned by someone else is refused: a socket there would let them
    speak for the engine.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        path = os.path.join(base, "mlxd")
    else:
        path = os.path.join(tempfile.gettempdir(), f"mlxd-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise PermissionError(f"runtime directory {path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def default_engine_endpoint() -> str:
    """The engine's default ZeroMQ endpoint: an ipc socket in the runtime directory."""
    return "ipc://" + os.path.join(runtime_dir(), "engine.sock")
