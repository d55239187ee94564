"""A recording HTTP proxy on loopback: what a coding CLI sends to mlxd, and what mlxd answers.

The CLIs under test talk to this proxy; it forwards each request unchanged to
the gateway, streams the answer back chunk by chunk (SSE included), and keeps
(method, path, request JSON, status, response bytes) of every exchange, so a
test can assert that every server response was 2xx and save the real requests
as fixtures.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass
from typing import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Headers that belong to one hop, not to the request.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
        "host", "content-length", "accept-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    body: object  # the request's JSON (None for an empty or non-JSON body)
    status: int
    response: bytes


class Recorder:
    """``with Recorder(upstream) as rec:``; the CLIs get ``rec.url``; ``rec.exchanges`` after."""

    def __init__(self, upstream: str, rewrite: Callable[[str, dict], dict] | None = None):
        """``rewrite(path, body)`` may change a JSON request before it is forwarded (a test makes a
        small model call a tool that way); the recorded body is what the client sent."""
        u = urlsplit(upstream)
        self.rewrite = rewrite
        self.upstream = (u.hostname, u.port)
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "Recorder":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _record(self, ex: Exchange) -> None:
        with self._lock:
            self.exchanges.append(ex)

    def _handler(self):
        rec = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet: the test prints what matters
                pass

            def _forward(self):
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                if isinstance(body, dict) and rec.rewrite is not None:
                    raw = json.dumps(rec.rewrite(self.path, json.loads(raw))).encode()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = http.client.HTTPConnection(*rec.upstream, timeout=600)
                try:
                    conn.request(self.command, self.path, body=raw or None, headers=headers)
                    up = conn.getresponse()
                    self.send_response(up.status)
                    for k, v in up.getheaders():
                        if k.lower() not in _HOP:
                            self.send_header(k, v)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    got = []
                    while True:
                        chunk = up.read1(65536)
                        if not chunk:
                            break
                        got.append(chunk)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    rec._record(Exchange(self.command, self.path, body, up.status, b"".join(got)))
                finally:
                    conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _forward

        return Handler
