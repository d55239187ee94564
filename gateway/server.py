"""`mlxd gateway`: the Starlette app under uvicorn, and how it shuts down.

On SIGTERM/SIGINT the gateway stops accepting connections and gives open
requests ``shutdown_timeout`` seconds to finish; then it ends each one that
is left with an error its client can read (a JSON error body, or an SSE
error event and ``[DONE]``) and aborts it in the engine, and exits.
uvicorn's own grace only has to cover writing those last words.
"""

from __future__ import annotations

import logging
import signal
import sys
import time

from shared.serve_config import GatewayConfig

log = logging.getLogger("mlxd.gateway")

# Seconds after the drain deadline for the error bodies and events to reach their clients.
_FLUSH_GRACE_S = 5.0
_TICK_S = 0.2


def run_gateway(config: GatewayConfig, supervisor=None) -> int:
    """Serve until interrupted; returns the exit code.

    ``supervisor`` (under `mlxd serve`; see mlxd/serve.py) is polled while the
    gateway runs: a non-None answer is the exit code serve ends with.
    """
    import asyncio

    import uvicorn

    from gateway.app import build_app
    from gateway.http_protocol import protocol_with_deadline

    if config.api_key_file is not None:
        config.api_key = _read_key_file(config.api_key_file)
    app = build_app(config)
    if config.enable_log_requests:
        from gateway.access_log import AccessLog

        asgi = AccessLog(app)
    else:
        asgi = app
    # uvicorn's own access log stays off: it knows no tokens, apps or time to first token.
    server = uvicorn.Server(uvicorn.Config(asgi, host=config.host, port=config.port,
                                           log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=config.shutdown_timeout + _FLUSH_GRACE_S,
                                           http=protocol_with_deadline(config.request_timeout)))
    client = app.state.gw.client
    print(f"mlxd gateway on http://{config.host}:{config.port}/v1 "
          f"(engine {client.endpoint})", file=sys.stderr, flush=True)

    async def main() -> int:
        task = asyncio.create_task(server.serve())
        rc, deadline, ended = 0, None, False
        while not task.done():
            await asyncio.sleep(_TICK_S)
            if supervisor is not None and not server.should_exit:
                code = supervisor.poll()
                if code is not None:
                    rc, server.should_exit = code, True
            if server.should_exit and deadline is None:
                deadline = time.monotonic() + config.shutdown_timeout
                log.info("shutting down: open requests get %.1fs to finish", config.shutdown_timeout)
            if deadline is not None and not ended and time.monotonic() >= deadline:
                ended = True
                n = client.end_all("the server is shutting down")
                if n:
                    log.info("ended %d request(s) still open after the shutdown timeout", n)
        await task
        return rc

    def on_signal(_signum, _frame):
        server.should_exit = True

    # uvicorn handles SIGINT/SIGTERM during serve() and raises the signal again when it returns,
    # under the handlers it found: these, so that the process is not killed there (by SIGTERM's
    # default action) before its callers stop the engine they started, and so that a signal
    # that comes before uvicorn listens still stops it.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return asyncio.run(main())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read_key_file(path: str) -> str:
    from shared.errors import InvalidRequestError

    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as e:
        raise InvalidRequestError(f"--api-key-file {path}: {e.strerror}", param="api_key_file") from e
    if not key:
        raise InvalidRequestError(f"--api-key-file {path} is empty", param="api_key_file")
    return key
