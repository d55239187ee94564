"""Command-line flags generated from the config Structs: each field is one flag with vLLM's name.

``add_struct_flags`` declares a Struct's fields on a parser, ``build_config``
makes the Struct back from parsed arguments, and ``to_flags`` writes the
flags that rebuild a Struct (how `serve` and `service install` start the
processes they run).
"""

from __future__ import annotations

import argparse
import types
import typing

import msgspec

HELP = {
    "model": "GGUF file, mlx_lm/Hugging Face directory or repo id (default: the embedded SmolLM2)",
    "served_model_name": "the model name clients use (default: derived from the model)",
    "max_model_len": "context length (default: the model's)",
    "gpu_memory_utilization": "fraction of device memory the engine may use",
    "kv_cache_memory": "KV pool size in bytes (overrides the fraction)",
    "num_kv_blocks": "KV pool size in blocks (overrides both)",
    "attention_backend": "paged attention implementation: auto, reference, host (numpy, CPU), metal, cuda",
    "engine_endpoint": "ZeroMQ endpoint of the engine (default: ipc socket in the runtime dir)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/*",
    "api_key_file": "like --api-key, the key read from this file (kept off command lines)",
    "chat_template": "Jinja chat template, or a file holding one (default: the model's)",
    "gateway_timeout": "seconds of silence after which a gateway's requests are aborted",
    "shutdown_timeout": "seconds in-flight requests get to finish on SIGTERM",
    "metrics_port": "serve the engine's Prometheus /metrics on this port (0: any free port)",
    "engine_timeout": "seconds of silence after which the engine is declared dead",
    "sse_keepalive": "seconds between keep-alive comments on an idle stream",
    "allowed_origins": "browser origins allowed to call the API, or '*' (default: none; requests with Origin refused)",
    "allowed_hosts": "Host names answered beyond loopback names, IP literals and --host, or '*' (DNS rebinding)",
    "trust_request_chat_template": "render chat templates sent in requests (default: refused)",
    "request_timeout": "seconds a client has to send its request head, and may pause within its body",
    "generation_config": "sampling defaults for omitted fields: auto (the model's generation_config.json), "
                         "vllm (none), or a folder holding one",
    "override_generation_config": "JSON object over those defaults, e.g. '{\"max_new_tokens\": 512}' "
                                  "(caps every request's max_tokens)",
    "enable_auto_tool_choice": "let the model call tools by itself (tool_choice auto); needs --tool-call-parser",
    "tool_call_parser": "the model's tool-call format, for reading calls and for required/named tool choice",
    "reasoning_parser": "split <think>...</think> into the message's reasoning field",
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


def add_struct_flags(parser: argparse.ArgumentParser, struct: type, skip=()) -> None:
    """One flag per field of ``struct`` (``--max-model-len`` for ``max_model_len``), except ``skip``."""
    hints = typing.get_type_hints(struct)
    for f in msgspec.structs.fields(struct):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, is_list = _base_type(hints[f.name])
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=HELP.get(f.name))
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif is_list:
            parser.add_argument(flag, type=tp, nargs="*", **kw)
        else:
            parser.add_argument(flag, type=tp, **kw)


def build_config(struct: type, ns: argparse.Namespace):
    """``struct`` from the parsed flags that name its fields (the others keep their defaults)."""
    names = {f.name for f in msgspec.structs.fields(struct)}
    return struct(**{k: v for k, v in vars(ns).items() if k in names})


def to_flags(obj, skip=()) -> list[str]:
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
