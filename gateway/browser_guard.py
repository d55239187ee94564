"""Keep web pages from driving the local server: Host, Origin and Content-Type checked on every request.

A page on any site can make a browser post to http://127.0.0.1:8000 (a
"simple" text/plain POST needs no CORS preflight), or rebind its own domain
name to 127.0.0.1 and read the answers. So:

- the Host header must be a loopback name, an IP literal, the configured
  ``--host`` or one of ``--allowed-hosts`` (a rebound domain carries its own
  name, which is none of these);
- a request carrying an Origin header (browsers send one on cross-origin and
  on all POST requests) is refused unless ``--allowed-origins`` lists it;
- a POST must declare a JSON body, which a page can only send after a CORS
  preflight that the rule above refuses.

Refusals are 403/415 in the shape of the route's API.
"""

from __future__ import annotations

import ipaddress

from gateway.errors import ANTHROPIC_PREFIX, error_response
from shared.errors import ForbiddenError, MlxdError, UnsupportedMediaTypeError

LOOPBACK_NAMES = ("localhost",)


def host_name(host: str) -> str:
    """The name or address of a Host header, without its port and brackets, lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BrowserGuard:
    """ASGI middleware; ``bind_host`` is the gateway's --host."""

    def __init__(self, app, bind_host: str, allowed_hosts: list[str], allowed_origins: list[str]):
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {host_name(h) for h in (bind_host, *allowed_hosts, *LOOPBACK_NAMES)}
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def check(self, method: str, headers: dict[bytes, bytes]) -> MlxdError | None:
        host = headers.get(b"host")
        if host is not None and not self.any_host:
            name = host_name(host.decode("latin-1"))
            if not (_is_ip(name) or name in self.hosts or name.endswith(".localhost")):
                return ForbiddenError(f"this server does not answer to the host name {name!r} "
                                      "(start it with --allowed-hosts to add one)")
        origin = headers.get(b"origin")
        if origin is not None and not self.any_origin:
            value = origin.decode("latin-1").rstrip("/").lower()
            if value not in self.origins:
                return ForbiddenError(f"requests from the web origin {value!r} are refused "
                                      "(start the server with --allowed-origins to allow one)")
        if method == "POST" and not is_json(headers.get(b"content-type", b"").decode("latin-1")):
            return UnsupportedMediaTypeError("the request body must be JSON, sent as Content-Type: application/json",
                                             param="content-type")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            err = self.check(scope["method"], headers)
            if err is not None:
                response = error_response(err, anthropic=scope["path"].startswith(ANTHROPIC_PREFIX))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
