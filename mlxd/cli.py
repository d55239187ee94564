"""The `mlxd` command: `serve`, `engine`, `gateway`, `service`, `keys`, `bench`.

Flags come from the config Structs (EngineConfig, DaemonConfig, GatewayConfig;
see mlxd/flags.py). A subcommand's module is imported only when it runs, so
the gateway never loads MLX, the engine never loads the HTTP stack, and
nothing below this package imports it back.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import signal
import sys

from mlxd import vllm_compat
from mlxd.flags import HELP, add_struct_flags
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import MlxdError
from mlxd.shared.serve_config import DaemonConfig, GatewayConfig, ModelSetConfig

# What `serve` and `service install` set on the gateway from the engine's flags of the same name.
SHARED_WITH_ENGINE = ("engine_endpoint", "curve_keys", "shutdown_timeout")
# What they write for the gateway of several models (mlxd/model_set.py).
SET_BY_SERVE = ("model_endpoints",)

# command -> "module:function" taking the parsed arguments, imported when the command runs.
COMMANDS = {
    "serve": "mlxd.serve:main",
    "engine": "mlxd.processes:engine",
    "gateway": "mlxd.processes:gateway",
    "service": "mlxd.service_command:main",
    "keys": "mlxd.keys_command:main",
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line: the usage of `serve` alone is a screenful."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _described(sub, name: str, help: str, **kw):
    """A subcommand whose --help says what it does (argparse shows ``help`` only in the parent's)."""
    return sub.add_parser(name, help=help, description=help, **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mlxd", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="the least severe messages logged (default: INFO)")
    # How `mlxd service` hands --env values (tokens, maybe) to its processes: never in a unit file.
    env_file = argparse.ArgumentParser(add_help=False)
    env_file.add_argument("--env-file", default=None, metavar="PATH",
                          help="KEY=VALUE lines set in this process's environment before it starts "
                               "(default: none)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = _described(sub, "serve", "run the engine and an OpenAI-compatible gateway", parents=[common])
    serve.add_argument("model_pos", nargs="*", metavar="MODEL", help=HELP["model"] + "; several: one engine each")
    add_struct_flags(serve, EngineConfig)
    add_struct_flags(serve, DaemonConfig)
    add_struct_flags(serve, GatewayConfig, skip=SHARED_WITH_ENGINE + SET_BY_SERVE)
    add_struct_flags(serve, ModelSetConfig)
    vllm_compat.add_flags(serve)

    engine = _described(sub, "engine", "run the engine daemon alone", parents=[common, env_file])
    engine.add_argument("model_pos", nargs="?", metavar="MODEL", help=HELP["model"])
    add_struct_flags(engine, EngineConfig)
    add_struct_flags(engine, DaemonConfig)
    # Set by `serve` for its child: the engine stops when the serve process is gone, and
    # writes one byte to this pipe once it serves (how serve tells a failed load from a crash).
    engine.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    engine.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)

    vllm_compat.add_flags(engine)
    gateway = _described(sub, "gateway", "run an OpenAI-compatible gateway to a running engine",
                         parents=[common, env_file])
    add_struct_flags(gateway, GatewayConfig)
    vllm_compat.add_flags(gateway)

    service = _described(sub, "service", "run the engine and a gateway in the background "
                                         "(launchd agents on macOS, systemd user units on Linux)")
    verbs = service.add_subparsers(dest="verb", required=True)
    manager = argparse.ArgumentParser(add_help=False)
    manager.add_argument("--manager", choices=("launchd", "systemd"), default=None,
                         help="default: launchd on macOS, systemd elsewhere")
    install = _described(verbs, "install", "write and load the services (again: update them in place)",
                         parents=[common, manager])
    install.add_argument("model_pos", nargs="*", metavar="MODEL", help=HELP["model"] + "; several: one engine each")
    add_struct_flags(install, EngineConfig)
    add_struct_flags(install, DaemonConfig)
    add_struct_flags(install, GatewayConfig, skip=SHARED_WITH_ENGINE + SET_BY_SERVE + ("model_load_timeout",))
    # The services keep every engine running: nothing is started on demand.
    add_struct_flags(install, ModelSetConfig, skip=("keep_alive",))
    install.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                         help="an environment variable of both services (repeatable)")
    vllm_compat.add_flags(install)
    uninstall = _described(verbs, "uninstall", "stop and remove all it installed", parents=[manager])
    uninstall.add_argument("--keep-logs", action="store_true", help="leave the log files (launchd)")
    for verb, what in (("start", "start the installed engine and gateway"),
                       ("stop", "stop them (they stay installed, and start again at the next login)"),
                       ("restart", "stop and start them, e.g. to load a new model file"),
                       ("status", "whether each service runs, and its process id")):
        _described(verbs, verb, what, parents=[manager])
    logs = _described(verbs, "logs", "the services' recent output", parents=[manager])
    logs.add_argument("-n", "--lines", type=int, default=50, help="how many lines (default: 50)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")

    # Listed for --help only: main() hands `bench` and its flags to the benchmark's parser.
    sub.add_parser("bench", add_help=False, help="load-test mlxd and its peers (see `mlxd bench --help`)")
    keys = sub.add_parser("keys", help="per-app API keys, and CurveZMQ keys for TCP beyond loopback")
    kverbs = keys.add_subparsers(dest="verb", required=True)
    keys_file = argparse.ArgumentParser(add_help=False)
    keys_file.add_argument("--keys-file", default=None, help=HELP["keys_file"])
    add = kverbs.add_parser("add", parents=[keys_file], help="make APP's key (printed once)")
    add.add_argument("app")
    add.add_argument("--loras", nargs="*", default=None, metavar="NAME",
                     help="the LoRA adapters APP may use (default: any; none named: only the base model)")
    loras = kverbs.add_parser("loras", parents=[keys_file], help="set the LoRA adapters APP's key may use")
    loras.add_argument("app")
    loras.add_argument("names", nargs="*", help="the adapters (none: only the base model)")
    loras.add_argument("--any", action="store_true", help="any adapter, as a key made without --loras")
    kverbs.add_parser("list", parents=[keys_file], help="the apps that have keys")
    kverbs.add_parser("revoke", parents=[keys_file], help="remove APP's key").add_argument("app")
    curve = kverbs.add_parser("curve", help="make CurveZMQ keys for the engine and its gateways")
    curve.add_argument("--dir", default=None, help="where (default: curve/ in the config dir)")
    return parser


def take_models(args) -> None:
    """The positional MODEL(s) as ``args.model`` (the first) and ``args.models`` (serve and service
    install take several: mlxd/model_set.py; the other commands one)."""
    positional = getattr(args, "model_pos", None)
    if positional:
        args.models = positional if isinstance(positional, list) else [positional]
        args.model = args.models[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # The benchmark has its own parser (bench/agent/harness.py); imported only here.
        from mlxd.bench.agent.harness import run as run_bench

        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    # `kill -USR1 PID` prints every thread's stack: how to see where a process hangs.
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError):
        pass  # no real stderr (embedded); the dump is a convenience
    take_models(args)
    # An engine of a set (mlxd/model_set.py names each) tags its lines with its model: the engines
    # of one `mlxd serve` write to the same log.
    served = getattr(args, "served_model_name", None) if args.command == "engine" else None
    tag = f" [{served.replace('%', '%%')}]" if served else ""
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format=f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s")
    # transformers' advice on import (that PyTorch was not found: mlxd never needs it) speaks of
    # training; its own switch silences its advice alone, in this process and those it starts.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    module, _, function = COMMANDS[args.command].partition(":")
    try:
        for line in vllm_compat.check(args):
            logging.getLogger("mlxd").warning("%s", line)
        return getattr(importlib.import_module(module), function)(args)
    except MlxdError as e:
        print(f"mlxd: {e.message}", file=sys.stderr)
        return 2
