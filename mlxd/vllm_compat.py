"""vLLM flags that mean nothing here, so that a `vllm serve ...` line copied as it is starts.

Each is accepted with one warning line when its value is what mlxd does anyway, and refused
in one line when it asks for something mlxd cannot do (``--tensor-parallel-size 2``).
"""

from __future__ import annotations

import argparse
import logging

from mlxd.shared.errors import InvalidRequestError

log = logging.getLogger("mlxd")

# flag -> (argparse keywords, the value mlxd behaves as, why it has no effect here).
# A value of None: any value is accepted (the flag changes nothing here).
FLAGS = {
    "--data-parallel-size": (dict(type=int), 1, "mlxd runs one engine per model"),
    "--enable-chunked-prefill": (dict(action=argparse.BooleanOptionalAction), True,
                                 "mlxd always prefills long prompts in chunks of --max-num-batched-tokens"),
    "--trust-remote-code": (dict(action="store_true"), None,
                            "mlxd runs no Python code from model repositories"),
    "--download-dir": (dict(metavar="DIR"), None,
                       "models download to the Hugging Face cache (set HF_HOME to move it)"),
    "--enforce-eager": (dict(action="store_true"), None, "mlxd has no CUDA graphs to turn off"),
    "--swap-space": (dict(type=float), None, "preempted requests are recomputed, never swapped"),
    "--disable-frontend-multiprocessing": (dict(action="store_true"), None,
                                           "the gateway is always its own process"),
    "--load-format": (dict(), None, "mlxd reads safetensors and GGUF by the files it finds"),
    "--kv-cache-dtype": (dict(), "auto", "the KV cache has the model's dtype"),
    "--uvicorn-log-level": (dict(), None, "the gateway's HTTP server logs at --log-level"),
}

_TP_ALIAS = {"--data-parallel-size": "-dp"}


def _dest(flag: str) -> str:
    return "vllm_" + flag[2:].replace("-", "_")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Declare the flags (hidden from --help: they do nothing) on ``parser``."""
    for flag, (kw, _, _) in FLAGS.items():
        names = [flag, *([_TP_ALIAS[flag]] if flag in _TP_ALIAS else [])]
        parser.add_argument(*names, dest=_dest(flag), default=None, help=argparse.SUPPRESS, **kw)
    # vLLM's deprecated spelling of the default (no request log); --enable-log-requests turns it on.
    parser.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                        default=argparse.SUPPRESS, help="vLLM's deprecated spelling of the default: "
                                                        "no access line per request")


def check(args: argparse.Namespace) -> list[str]:
    """The warning lines for the flags given; InvalidRequestError for a value mlxd cannot honour."""
    warnings = []
    for flag, (_, same, why) in FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is None or value is False and same is None:
            continue
        if same is not None and value != same:
            raise InvalidRequestError(f"{flag} {value} is not supported: {why}", param=flag[2:].replace("-", "_"))
        warnings.append(f"{flag} has no effect in mlxd ({why}); ignored")
    return warnings
