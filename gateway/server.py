"""`mlxd gateway`: the Starlette app under uvicorn."""

from __future__ import annotations

import logging
import subprocess
import sys

from shared.serve_config import GatewayConfig

log = logging.getLogger("mlxd.gateway")


def run_gateway(config: GatewayConfig, engine_process: subprocess.Popen | None = None) -> int:
    """Serve until interrupted; returns the exit code.

    With ``engine_process`` (under `mlxd serve`), the gateway also stops when
    that engine exits for good (a failed load), rather than answering 503 forever.
    """
    import asyncio

    import uvicorn

    from gateway.app import build_app
    from gateway.http_protocol import protocol_with_deadline

    app = build_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=3,
                                           http=protocol_with_deadline(config.request_timeout)))
    print(f"mlxd gateway on http://{config.host}:{config.port}/v1 "
          f"(engine {app.state.gw.client.endpoint})", file=sys.stderr, flush=True)

    async def main() -> int:
        task = asyncio.create_task(server.serve())
        while not task.done():
            await asyncio.sleep(0.5)
            if engine_process is not None and engine_process.poll() is not None:
                print(f"mlxd: the engine exited with code {engine_process.returncode}",
                      file=sys.stderr, flush=True)
                server.should_exit = True
                await task
                return engine_process.returncode or 1
        await task
        return 0

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal.
        return 0
