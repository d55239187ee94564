"""`mlxd service install|uninstall|start|stop|restart|status|logs`.

An ``--api-key`` is never written into a unit file or onto a command line
(both readable by other users: `ps`, a 0644 plist): it goes into a 0600 file
beside the keys, and the gateway is given ``--api-key-file``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mlxd.flags import build_config, to_flags
from shared.config import EngineConfig
from shared.serve_config import DaemonConfig, GatewayConfig


def api_key_path() -> Path:
    from shared.paths import config_dir

    return Path(config_dir()) / "service-api-key"


def main(args) -> int:
    from service import managers
    from service.jobs import Job, service_env, write_atomic

    manager = managers.make_manager(args.manager or managers.default_manager())
    jobs = None
    if args.verb == "install":
        from shared.paths import default_engine_endpoint

        engine_cfg = build_config(EngineConfig, args)
        daemon_cfg = build_config(DaemonConfig, args)
        # Written out in full so that both services agree whatever environment the manager gives them.
        daemon_cfg.engine_endpoint = daemon_cfg.engine_endpoint or default_engine_endpoint()
        gateway_cfg = build_config(GatewayConfig, args)
        gateway_cfg.engine_endpoint = daemon_cfg.engine_endpoint
        gateway_cfg.curve_keys = daemon_cfg.curve_keys
        gateway_cfg.shutdown_timeout = daemon_cfg.shutdown_timeout
        key_file = api_key_path()
        if gateway_cfg.api_key is not None:
            write_atomic(key_file, gateway_cfg.api_key.encode(), mode=0o600)
            gateway_cfg.api_key, gateway_cfg.api_key_file = None, str(key_file)
        else:
            key_file.unlink(missing_ok=True)  # a re-install without a key drops the old one
        env = service_env(args.env)
        head = [sys.executable, "-m", "mlxd"]
        jobs = [Job("engine", [*head, "engine", "--log-level", args.log_level,
                               *to_flags(engine_cfg), *to_flags(daemon_cfg)], env),
                Job("gateway", [*head, "gateway", "--log-level", args.log_level,
                                *to_flags(gateway_cfg)], env)]
    try:
        rc = managers.run(args.verb, manager, jobs, keep_logs=getattr(args, "keep_logs", False),
                          lines=getattr(args, "lines", 50), follow=getattr(args, "follow", False))
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"mlxd service {args.verb}: {e}", file=sys.stderr)
        return 1
    if args.verb == "uninstall":
        api_key_path().unlink(missing_ok=True)
    return rc
