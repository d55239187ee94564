"""A busy --port or --metrics-port found before the model loads, in one line."""

from __future__ import annotations

import errno
import socket

from mlxd.shared.errors import InvalidRequestError


def check_free(host: str, port: int | None, flag: str) -> None:
    """InvalidRequestError when ``host:port`` cannot be bound now; port None or 0 is not checked.

    The socket is bound as the servers bind theirs (SO_REUSEADDR, so a port in TIME_WAIT passes
    here as it does there) and closed again at once.
    """
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                why = "is in use by another process (another mlxd or vLLM?)"
            elif e.errno == errno.EACCES:
                why = "needs privileges this process lacks"
            else:
                why = f"cannot be bound: {e.strerror}"
            raise InvalidRequestError(f"{flag} {port} on {host} {why}; stop that process or pick another "
                                      f"{flag}", param=flag[2:].replace("-", "_")) from None
