"""`mlxd serve`: the engine as a supervised child process (mlxd/supervisor.py), and a gateway in
this one. Several models (``mlxd serve A B``, ``--models-file``, ``--keep-alive``) are an engine
each, supervised together by mlxd/fleet.py.

SIGTERM or SIGINT stops both at once, under one ``--shutdown-timeout``: the
gateway stops taking connections and tells the engine (``begin_stop``), and
both let what runs finish until the same deadline, then end it with an error
each client reads. The engine exits after the step it is in (a step is one MLX
call, which nothing interrupts); serve waits that long, up to
``STEP_GRACE_S`` (mlxd/supervisor.py), so that the whole process tree exits within the timeout and
one step, before a service manager's own stop timeout has to kill it.
"""

from __future__ import annotations

import fcntl
import os
import signal

from mlxd.flags import build_config, engine_daemon, gateway_beside
from mlxd.ports import check_free
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.serve_config import ModelSetConfig
from mlxd.supervisor import EngineSupervisor, check_model_path, engine_argv


def hold_endpoint(endpoint: str):
    """A lock on an ipc endpoint's socket path for this process's lifetime (the open file), or None
    for other transports; InvalidRequestError, in one line, when another serve holds it."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):] + ".lock"
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise InvalidRequestError(f"another mlxd serve (pid {holder}) is using {endpoint}; stop it first, "
                                  "or give this one another --engine-endpoint", param="engine_endpoint") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def main(args) -> int:
    from mlxd.shared.paths import check_ipc_endpoint, refuse_live_ipc

    engine_cfg = build_config(EngineConfig, args)
    daemon_cfg = engine_daemon(args)
    models = getattr(args, "models", None) or []
    model_set = build_config(ModelSetConfig, args)
    if len(models) > 1 or model_set.models_file or model_set.keep_alive is not None:
        from mlxd.fleet import build_fleet

        supervisor, daemons = build_fleet(engine_cfg, daemon_cfg, models, model_set, args.log_level)
        gateway_cfg = gateway_beside(args, daemon_cfg, model_endpoints=list(supervisor.endpoint_entries))
    else:
        check_model_path(engine_cfg.model)
        daemons = [daemon_cfg]
        supervisor = EngineSupervisor(engine_argv(engine_cfg, daemon_cfg, args.log_level))
        gateway_cfg = gateway_beside(args, daemon_cfg)

    # Before anything loads: a missing model file, another serve (or engine) on this endpoint, or on
    # either port, is one line, not a traceback after the load.
    check_free(gateway_cfg.host, gateway_cfg.port, "--port")
    locks = []
    for d in daemons:
        check_free(d.metrics_host, d.metrics_port, "--metrics-port")
        check_ipc_endpoint(d.engine_endpoint)
        locks.append(hold_endpoint(d.engine_endpoint))
        refuse_live_ipc(d.engine_endpoint)

    def on_signal(_signum, _frame):
        supervisor.stop_requested = True

    # From now on a SIGTERM stops serve through its `finally` (the engine with it), never by
    # the signal's default action, which would leave the engine running on its own.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        supervisor.start()
        from mlxd.gateway.server import run_gateway

        return run_gateway(gateway_cfg, supervisor=supervisor)
    finally:
        supervisor.stop(daemon_cfg.shutdown_timeout)
        for lock in locks:
            if lock is not None:
                lock.close()
