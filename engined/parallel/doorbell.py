"""An idle pipeline's doorbell: worker ranks wait in the OS, not in MLX's polling receive, until rank 0 has work.

MLX's ring backend receives on non-blocking sockets, retrying on EAGAIN while a
receive is pending, so a worker waiting in ``mx.distributed.recv`` for rank 0's
next message keeps a core busy for as long as rank 0 has nothing to send (99 %
of a core, idle, on this machine; on a Mac, its battery). When nothing is in
flight rank 0 says so (``Link.rest``) and each worker then blocks in a plain
``recv`` on its own TCP connection to rank 0, until rank 0 writes one byte
there just before its next message (``Link.send``); the worker then enters
``mx.distributed.recv`` again, where that message is already arriving.

Rank 0's address is the one the ranks were launched with: the ring's host file
(``MLX_HOSTFILE``) or JACCL's coordinator (``MLX_JACCL_COORDINATOR``, which is
rank 0). A rank 0 that exits closes the connection, which ends a resting
worker; one whose machine vanishes is noticed by TCP keepalive within about
``--pipeline-timeout``. Without an address (another backend), or where a
worker cannot connect, every rank goes without and idle workers poll.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket

log = logging.getLogger("mlxd.engine")

_SECRET_BYTES = 7  # fits the int64 the ranks exchange it in


def rank0_host() -> str | None:
    """Rank 0's address from the launcher's environment, or None where it gave none."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        try:
            with open(hostfile) as f:
                return json.load(f)[0][0].rsplit(":", 1)[0].strip("[]")
        except (OSError, ValueError, LookupError, AttributeError):
            return None
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    return coordinator.rsplit(":", 1)[0].strip("[]") if coordinator else None


class Doorbell:
    """Rank 0's end rings every worker; a worker's end waits for the ring."""

    def __init__(self, conns: list[socket.socket]):
        self.conns = conns  # rank 0: one per worker; a worker: its one to rank 0

    def ring(self) -> None:
        """Rank 0: wake every resting worker (each gets one byte per rest)."""
        for conn in self.conns:
            try:
                conn.sendall(b"w")
            except OSError as e:  # the worker is gone: as its ring link breaking would say
                raise RuntimeError(f"pipeline: a rank is gone (its wake connection: {e})") from e

    def wait(self) -> bool:
        """A worker: block until rank 0 rings (True) or is gone (False)."""
        try:
            return self.conns[0].recv(1) == b"w"
        except OSError:  # keepalive gave up on rank 0's machine, or the connection was reset
            return False


def connect(rank: int, size: int, exchange, timeout: float) -> Doorbell | None:
    """Every rank calls this at the same point: ``exchange`` (``Link.exchange``: every rank's list of
    ints, a row each; an all-gather, so also a barrier) spreads rank 0's port and a secret, the
    workers connect, and each rank gets its end, or None for all of them where rank 0 has no
    address or any worker could not connect."""
    host, listener, mine = rank0_host(), None, [0, 0]
    if rank == 0 and host is not None:
        try:
            listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                            backlog=size)
            mine = [listener.getsockname()[1], int.from_bytes(secrets.token_bytes(_SECRET_BYTES), "big")]
        except OSError as e:
            log.warning("pipeline: no wake socket on %s (%s): idle ranks will poll", host, e)
    port, secret = (int(v) for v in exchange(mine)[0])
    conn = None
    if rank > 0 and port:
        try:
            if host is None:
                raise OSError("the launcher gave this rank no address for rank 0")
            conn = socket.create_connection((host, port), timeout=timeout)
            conn.sendall(secret.to_bytes(_SECRET_BYTES, "big"))
            conn.settimeout(None)
            _keepalive(conn, timeout)
        except OSError as e:
            log.warning("pipeline rank %d: cannot reach rank 0's wake socket %s:%d (%s): idle ranks will poll",
                        rank, host, port, e)
            conn = None
    connected = exchange([int(conn is not None or rank == 0)]).min()
    if not port or not connected:
        for s in (listener, conn):
            if s is not None:
                s.close()
        return None
    if rank > 0:
        return Doorbell([conn])
    return Doorbell(_accept(listener, size - 1, secret, timeout))


def _accept(listener: socket.socket, count: int, secret: int, timeout: float) -> list[socket.socket]:
    """``count`` connections that open with ``secret`` (the workers'; anyone else's is dropped)."""
    conns = []
    listener.settimeout(timeout)
    with listener:
        while len(conns) < count:
            conn, _ = listener.accept()
            conn.settimeout(timeout)
            try:
                ok = _read(conn, _SECRET_BYTES) == secret.to_bytes(_SECRET_BYTES, "big")
            except OSError:
                ok = False
            if ok:
                conn.settimeout(None)
                conns.append(conn)
            else:
                conn.close()
    return conns


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n and (chunk := conn.recv(n - len(data))):
        data += chunk
    return data


def _keepalive(conn: socket.socket, timeout: float) -> None:
    """Probe a quiet connection so that a vanished peer ends a wait within about ``timeout``."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))  # Linux / macOS
    for option, value in ((idle, timeout / 2), (getattr(socket, "TCP_KEEPINTVL", None), timeout / 4),
                          (getattr(socket, "TCP_KEEPCNT", None), 2)):
        if option is not None:
            conn.setsockopt(socket.IPPROTO_TCP, option, max(1, int(value)))
