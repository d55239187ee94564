"""`mlxd service install|uninstall|start|stop|restart|status|logs`.

An ``--api-key`` is never written into a unit file or onto a command line
(both readable by other users: `ps`, a 0644 plist): it goes into a 0600 file
beside the keys, and the gateway is given ``--api-key-file``. ``--env`` values
(an HF_TOKEN, say) likewise go into a 0600 file that both processes read
(``--env-file``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from mlxd.flags import build_config, engine_daemon, gateway_beside, to_flags
from mlxd.shared.config import EngineConfig
from mlxd.shared.serve_config import ModelSetConfig


def api_key_path() -> Path:
    from mlxd.shared.paths import config_dir

    return Path(config_dir()) / "service-api-key"


def env_file_path() -> Path:
    from mlxd.shared.paths import config_dir

    return Path(config_dir()) / "service.env"


def _keep_private(path: Path, data: bytes | None) -> str | None:
    """Write ``data`` to ``path`` readable by its owner alone; None: remove it (a re-install without it)."""
    from mlxd.service.jobs import write_atomic

    if data is None:
        path.unlink(missing_ok=True)
        return None
    write_atomic(path, data, mode=0o600)
    return str(path)


def main(args) -> int:
    from mlxd.service import managers

    manager = managers.make_manager(args.manager or managers.default_manager())
    jobs = None
    try:
        if args.verb in managers.SESSION_VERBS:
            manager.require_session()  # before anything is written: a refusal leaves nothing behind
        if args.verb == "install":
            jobs = _jobs(args)
        rc = managers.run(args.verb, manager, jobs, keep_logs=getattr(args, "keep_logs", False),
                          lines=getattr(args, "lines", 50), follow=getattr(args, "follow", False))
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"mlxd service {args.verb}: {e}", file=sys.stderr)
        return 1
    if args.verb == "uninstall":
        api_key_path().unlink(missing_ok=True)
        env_file_path().unlink(missing_ok=True)
    return rc


def _jobs(args) -> list:
    """The engines' and the gateway's command lines and environment, from the install's flags: an
    engine job per model of a set (mlxd/model_set.py), "engine-0", "engine-1", ...; else one, "engine"."""
    from mlxd.service.jobs import Job, env_items, format_env_file, mlxd_command, service_env

    engine_cfg = build_config(EngineConfig, args)
    daemon_cfg = engine_daemon(args)
    secrets = env_items(args.env)  # checked before anything is written
    head = [mlxd_command()]
    api_key = vars(args).get("api_key")
    key_file = _keep_private(api_key_path(), None if api_key is None else api_key.encode())
    # A key given on the command line reaches the gateway's service as a file only this user reads.
    key = {} if key_file is None else {"api_key": None, "api_key_file": key_file}
    env_file = _keep_private(env_file_path(), format_env_file(secrets) if secrets else None)
    tail = ["--env-file", env_file] if env_file else []
    env = service_env()
    models = getattr(args, "models", None) or []
    model_set = build_config(ModelSetConfig, args)
    if len(models) > 1 or model_set.models_file:
        from mlxd.model_set import plan_models

        plans = plan_models(engine_cfg, daemon_cfg, models, model_set.models_file)
        gateway_cfg = gateway_beside(args, daemon_cfg, model_endpoints=[p.endpoint_entry for p in plans], **key)
        engines = [(f"engine-{n}", p.engine, p.daemon) for n, p in enumerate(plans)]
    else:
        gateway_cfg = gateway_beside(args, daemon_cfg, **key)
        engines = [("engine", engine_cfg, daemon_cfg)]
    return [*(Job(name, [*head, "engine", "--log-level", args.log_level, *to_flags(e), *to_flags(d), *tail], env)
              for name, e, d in engines),
            Job("gateway", [*head, "gateway", "--log-level", args.log_level, *to_flags(gateway_cfg), *tail], env)]
