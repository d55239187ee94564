"""The `mlxd` command: `serve`, `engine`, `gateway`, `service`, `keys`.

Flags are generated from the config Structs (EngineConfig, DaemonConfig,
GatewayConfig): each field is one flag with vLLM's name. Each subcommand
imports its process's package only when it runs, so the gateway never loads
MLX and the engine never loads the HTTP stack.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import subprocess
import sys
import types
import typing

import msgspec

from shared.config import EngineConfig
from shared.errors import MlxdError
from shared.serve_config import DaemonConfig, GatewayConfig

_HELP = {
    "model": "GGUF file, mlx_lm/Hugging Face directory or repo id (default: the embedded SmolLM2)",
    "served_model_name": "the model name clients use (default: derived from the model)",
    "max_model_len": "context length (default: the model's)",
    "gpu_memory_utilization": "fraction of device memory the engine may use",
    "kv_cache_memory": "KV pool size in bytes (overrides the fraction)",
    "num_kv_blocks": "KV pool size in blocks (overrides both)",
    "engine_endpoint": "ZeroMQ endpoint of the engine (default: ipc socket in the runtime dir)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/*",
    "chat_template": "Jinja chat template, or a file holding one (default: the model's)",
    "gateway_timeout": "seconds of silence after which a gateway's requests are aborted",
    "shutdown_timeout": "seconds in-flight requests get to finish on SIGTERM",
    "metrics_port": "serve the engine's Prometheus /metrics on this port (0: any free port)",
    "engine_timeout": "seconds of silence after which the engine is declared dead",
    "sse_keepalive": "seconds between keep-alive comments on an idle stream",
    "allowed_origins": "CORS origins allowed (default: none)",
    "enable_auto_tool_choice": "let the model call tools by itself (tool_choice auto); needs --tool-call-parser",
    "tool_call_parser": "the model's tool-call format, for reading calls and for required/named tool choice",
    "reasoning_parser": "split <think>...</think> into the message's reasoning field",
    "generation_config": "sampling defaults for omitted fields: auto (the model's generation_config.json), "
                         "vllm (none), or a folder holding one",
    "override_generation_config": "JSON object over those defaults, e.g. '{\"max_new_tokens\": 512}' "
                                  "(caps every request's max_tokens)",
    "keys_file": "per-app API keys made by `mlxd keys add` (default: keys.json in the config dir)",
    "curve_keys": "directory of CurveZMQ keys (`mlxd keys curve`); needed for TCP beyond loopback",
}


def _base_type(tp):
    """int for `int | None`, and so on; (type, is_list)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True
    return tp, False


def _add_struct_flags(parser: argparse.ArgumentParser, struct: type, skip=()) -> None:
    hints = typing.get_type_hints(struct)
    for f in msgspec.structs.fields(struct):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, is_list = _base_type(hints[f.name])
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=_HELP.get(f.name))
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif is_list:
            parser.add_argument(flag, type=tp, nargs="*", **kw)
        else:
            parser.add_argument(flag, type=tp, **kw)


def _build(struct: type, ns: argparse.Namespace):
    names = {f.name for f in msgspec.structs.fields(struct)}
    return struct(**{k: v for k, v in vars(ns).items() if k in names})


def _to_flags(obj, skip=()) -> list[str]:
    """The flags that rebuild ``obj`` (fields left at their default are omitted)."""
    out = []
    for f in msgspec.structs.fields(type(obj)):
        v = getattr(obj, f.name)
        if f.name in skip or v == f.default or v is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, list):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxd", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", parents=[common],
                           help="run the engine and an OpenAI-compatible gateway")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", help=_HELP["model"])
    _add_struct_flags(serve, EngineConfig)
    _add_struct_flags(serve, DaemonConfig)
    _add_struct_flags(serve, GatewayConfig, skip=("engine_endpoint", "curve_keys"))

    engine = sub.add_parser("engine", parents=[common], help="run the engine daemon alone")
    engine.add_argument("model_pos", nargs="?", metavar="MODEL", help=_HELP["model"])
    _add_struct_flags(engine, EngineConfig)
    _add_struct_flags(engine, DaemonConfig)
    # Set by `serve` for its child: the engine stops when the serve process is gone.
    engine.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)

    gateway = sub.add_parser("gateway", parents=[common],
                             help="run an OpenAI-compatible gateway to a running engine")
    _add_struct_flags(gateway, GatewayConfig)

    service = sub.add_parser("service", help="run the engine and a gateway in the background "
                                             "(launchd agents on macOS, systemd user units on Linux)")
    verbs = service.add_subparsers(dest="verb", required=True)
    manager = argparse.ArgumentParser(add_help=False)
    manager.add_argument("--manager", choices=("launchd", "systemd"), default=None,
                         help="default: launchd on macOS, systemd elsewhere")
    install = verbs.add_parser("install", parents=[common, manager],
                               help="write and load the services (again: update them in place)")
    install.add_argument("model_pos", nargs="?", metavar="MODEL", help=_HELP["model"])
    _add_struct_flags(install, EngineConfig)
    _add_struct_flags(install, DaemonConfig)
    _add_struct_flags(install, GatewayConfig, skip=("engine_endpoint", "curve_keys"))
    install.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                         help="an environment variable of both services (repeatable)")
    uninstall = verbs.add_parser("uninstall", parents=[manager], help="stop and remove all it installed")
    uninstall.add_argument("--keep-logs", action="store_true", help="leave the log files (launchd)")
    for verb in ("start", "stop", "restart", "status"):
        verbs.add_parser(verb, parents=[manager])
    logs = verbs.add_parser("logs", parents=[manager], help="the services' recent output")
    logs.add_argument("-n", "--lines", type=int, default=50)
    logs.add_argument("-f", "--follow", action="store_true")

    # Listed for --help only: main() hands `bench` and its flags to the benchmark's parser.
    sub.add_parser("bench", add_help=False, help="load-test mlxd and its peers (see `mlxd bench --help`)")
    keys = sub.add_parser("keys", help="per-app API keys, and CurveZMQ keys for TCP beyond loopback")
    kverbs = keys.add_subparsers(dest="verb", required=True)
    keys_file = argparse.ArgumentParser(add_help=False)
    keys_file.add_argument("--keys-file", default=None, help=_HELP["keys_file"])
    kverbs.add_parser("add", parents=[keys_file], help="make APP's key (printed once)").add_argument("app")
    kverbs.add_parser("list", parents=[keys_file], help="the apps that have keys")
    kverbs.add_parser("revoke", parents=[keys_file], help="remove APP's key").add_argument("app")
    curve = kverbs.add_parser("curve", help="make CurveZMQ keys for the engine and its gateways")
    curve.add_argument("--dir", default=None, help="where (default: curve/ in the config dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # The benchmark has its own parser (bench/agent/harness.py); imported only here.
        from bench.agent.harness import run as run_bench

        return run_bench(argv[1:])
    args = _parser().parse_args(argv)
    # `kill -USR1 PID` prints every thread's stack: how to see where a process hangs.
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError):
        pass  # no real stderr (embedded); the dump is a convenience
    logging.basicConfig(level=getattr(args, "log_level", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "model_pos", None):
        args.model = args.model_pos
    try:
        return {"serve": _serve, "engine": _engine, "gateway": _gateway, "service": _service,
                "keys": _keys}[args.command](args)
    except MlxdError as e:
        print(f"mlxd: {e.message}", file=sys.stderr)
        return 2


def _engine(args) -> int:
    from engined.__main__ import run_engine

    return run_engine(_build(EngineConfig, args), _build(DaemonConfig, args), parent_pid=args.parent_pid)


def _gateway(args) -> int:
    from gateway.server import run_gateway

    return run_gateway(_build(GatewayConfig, args))


def _keys(args) -> int:
    import datetime

    from shared import keys as k

    path = getattr(args, "keys_file", None) or k.default_keys_file()
    if args.verb == "add":
        key = k.add_key(path, args.app)
        print(f"key of {args.app} (shown only now; clients send 'Authorization: Bearer KEY'):",
              file=sys.stderr)
        print(key)
    elif args.verb == "list":
        for entry in k.read_keys(path).keys:
            created = datetime.datetime.fromtimestamp(entry.created).isoformat(timespec="seconds")
            print(f"{entry.app}\tmlxd_{entry.key_id}_...\t{created}")
    elif args.verb == "revoke":
        if not k.revoke_key(path, args.app):
            print(f"mlxd: app {args.app!r} has no key", file=sys.stderr)
            return 1
    else:
        from shared.curve import default_curve_dir, make_keys

        directory = make_keys(args.dir or default_curve_dir())
        print(f"CurveZMQ keys in {directory}: pass --curve-keys {directory} to the engine and the gateways",
              file=sys.stderr)
    return 0


def _service(args) -> int:
    from launchd import service

    manager = service.make_manager(args.manager or service.default_manager())
    jobs = None
    if args.verb == "install":
        from shared.paths import default_engine_endpoint

        engine_cfg = _build(EngineConfig, args)
        daemon_cfg = _build(DaemonConfig, args)
        # Written out in full so that both services agree whatever environment the manager gives them.
        daemon_cfg.engine_endpoint = daemon_cfg.engine_endpoint or default_engine_endpoint()
        gateway_cfg = _build(GatewayConfig, args)
        gateway_cfg.engine_endpoint = daemon_cfg.engine_endpoint
        gateway_cfg.curve_keys = daemon_cfg.curve_keys
        env = service.service_env(args.env)
        head = [sys.executable, "-m", "shared.cli"]
        jobs = [service.Job("engine", [*head, "engine", "--log-level", args.log_level,
                                       *_to_flags(engine_cfg), *_to_flags(daemon_cfg)], env),
                service.Job("gateway", [*head, "gateway", "--log-level", args.log_level,
                                        *_to_flags(gateway_cfg)], env)]
    try:
        return service.run(args.verb, manager, jobs, keep_logs=getattr(args, "keep_logs", False),
                           lines=getattr(args, "lines", 50), follow=getattr(args, "follow", False))
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"mlxd service {args.verb}: {e}", file=sys.stderr)
        return 1


def _serve(args) -> int:
    from shared.paths import default_engine_endpoint

    engine_cfg = _build(EngineConfig, args)
    daemon_cfg = _build(DaemonConfig, args)
    if daemon_cfg.engine_endpoint is None:
        daemon_cfg.engine_endpoint = default_engine_endpoint()
    gateway_cfg = _build(GatewayConfig, args)
    gateway_cfg.engine_endpoint = daemon_cfg.engine_endpoint
    gateway_cfg.curve_keys = daemon_cfg.curve_keys

    cmd = [sys.executable, "-m", "engined", "--log-level", args.log_level,
           *_to_flags(engine_cfg), *_to_flags(daemon_cfg), "--parent-pid", str(os.getpid())]
    child = subprocess.Popen(cmd)
    try:
        from gateway.server import run_gateway

        rc = run_gateway(gateway_cfg, engine_process=child)
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=daemon_cfg.shutdown_timeout + 10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    return rc


if __name__ == "__main__":
    sys.exit(main())
