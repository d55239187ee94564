"""CurveZMQ between gateways and the engine: what a TCP endpoint beyond loopback requires.

Plain ZeroMQ over TCP is readable and writable by anyone on the network: every
prompt and every token in the clear, and anyone able to connect can submit
work. So the engine refuses to bind, and a gateway to connect, a TCP endpoint
that is not a loopback address unless CurveZMQ keys are given; with keys, the
link is encrypted and the engine accepts only gateways whose public keys it
holds. Keys on loopback are allowed (and tested): the same path, forced.

A key directory, as `mlxd keys curve` writes it::

    engine.key  engine.key_secret     the engine's pair; gateways need engine.key
    gateway.key gateway.key_secret    a gateway's pair
    authorized/gateway.key            public keys of the gateways the engine accepts

Copy the directory without engine.key_secret to a gateway's machine.
"""

from __future__ import annotations

import ipaddress
import os
import shutil

import zmq
import zmq.auth

from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.paths import check_private_dir, config_dir


class InsecureEndpointError(InvalidRequestError):
    """A TCP endpoint off loopback without CurveZMQ keys, or keys that cannot be used."""


def default_curve_dir() -> str:
    return os.path.join(config_dir(), "curve")


def is_loopback(endpoint: str) -> bool:
    """True for ipc/inproc endpoints and TCP on a loopback address; False for anything else.

    Wildcards (``*``, ``0.0.0.0``), interface names and host names other than
    localhost count as not loopback: they may reach other machines.
    """
    transport, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rsplit(":", 1)[0]
    if ";" in host:  # tcp://source;destination: the destination decides
        host = host.split(";", 1)[1]
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_keys(directory: str) -> str:
    """Write an engine pair, a gateway pair and the engine's authorized list; returns the directory.

    An existing directory keeps its keys (gateways elsewhere hold copies); only
    missing pairs are made.
    """
    check_private_dir(directory)
    for name in ("engine", "gateway"):
        if not os.path.exists(os.path.join(directory, f"{name}.key_secret")):
            _, secret_file = zmq.auth.create_certificates(directory, name)
            os.chmod(secret_file, 0o600)
    authorized = check_private_dir(os.path.join(directory, "authorized"))
    target = os.path.join(authorized, "gateway.key")
    if not os.path.exists(target):
        shutil.copyfile(os.path.join(directory, "gateway.key"), target)
    return directory


def _load(path: str, secret: bool):
    if not os.path.exists(path):
        raise InsecureEndpointError(f"CurveZMQ key file {path} is missing (make keys with `mlxd keys curve`)",
                                    param="curve_keys")
    if secret and os.stat(path).st_mode & 0o077:
        raise InsecureEndpointError(f"CurveZMQ secret key {path} is readable by other users; "
                                    f"run `chmod 600 {path}`", param="curve_keys")
    public, secret_key = zmq.auth.load_certificate(path)
    if secret and secret_key is None:
        raise InsecureEndpointError(f"{path} holds no secret key", param="curve_keys")
    return public, secret_key


def check_endpoint(endpoint: str, curve_keys: str | None) -> None:
    """Refuse TCP off loopback without keys; the message says what to do."""
    if curve_keys is None and not is_loopback(endpoint):
        raise InsecureEndpointError(
            f"{endpoint} is not a loopback address: the engine's socket there needs CurveZMQ keys. "
            f"Make them with `mlxd keys curve` and pass --curve-keys DIR to the engine and the gateways, "
            f"or use tcp://127.0.0.1:PORT or an ipc:// endpoint", param="engine_endpoint")


def secure_server(ctx: zmq.Context, sock: zmq.Socket, endpoint: str, curve_keys: str | None):
    """Make ``sock`` a CURVE server before it binds; returns the authenticator to stop, or None.

    The authenticator (a ZAP handler thread on ``ctx``) lets in only the
    gateways whose public keys are in ``<curve_keys>/authorized``.
    """
    check_endpoint(endpoint, curve_keys)
    if curve_keys is None:
        return None
    public, secret = _load(os.path.join(curve_keys, "engine.key_secret"), secret=True)
    authorized = os.path.join(curve_keys, "authorized")
    if not os.path.isdir(authorized) or not any(f.endswith(".key") for f in os.listdir(authorized)):
        raise InsecureEndpointError(f"{authorized} holds no gateway public key: no gateway could connect",
                                    param="curve_keys")
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=authorized)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def secure_client(sock: zmq.Socket, endpoint: str, curve_keys: str | None) -> None:
    """Make ``sock`` a CURVE client of the engine before it connects (no-op without keys)."""
    check_endpoint(endpoint, curve_keys)
    if curve_keys is None:
        return
    public, secret = _load(os.path.join(curve_keys, "gateway.key_secret"), secret=True)
    server_public, _ = _load(os.path.join(curve_keys, "engine.key"), secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public
