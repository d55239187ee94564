"""Command-line flags generated from the config Structs: each field is one flag with vLLM's name.

``add_struct_flags`` declares a Struct's fields on a parser, ``build_config``
makes the Struct back from parsed arguments, and ``to_flags`` writes the
flags that rebuild a Struct (how `serve` and `service install` start the
processes they run).
"""

from __future__ import annotations

import argparse
import re
import types
import typing

import msgspec

from mlxd.shared.config import ATTENTION_BACKENDS, DTYPES, ENGINE_TASKS
from mlxd.shared.serve_config import DaemonConfig, GatewayConfig

HELP = {
    "model": "GGUF file, mlx_lm/Hugging Face directory or repo id (default: the embedded SmolLM2)",
    "served_model_name": "the model name clients use (default: derived from the model)",
    "max_model_len": "context length; takes 32k (32000) or 32K (32768) as vLLM does (default: the model's)",
    "max_num_seqs": "most requests in the running batch (default: 32 on the CPU, 128 on a GPU)",
    "max_num_batched_tokens": "most tokens computed in one engine step (long prompts are prefilled in chunks of "
                              "it; default: 1024 on the CPU, 8192 on a GPU)",
    "max_waiting_requests": "requests queued beyond the running ones; past this new ones get HTTP 429",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "reuse the KV cache of prompt prefixes seen before",
    "kv_disk_cache": "keep cached prefix blocks evicted from memory, and the last sessions', in files read "
                     "back instead of recomputed, also after a restart",
    "kv_cache_dir": "folder of the KV disk cache (default: kv/ in the user's cache dir, ~/.cache/mlxd)",
    "kv_disk_budget": "most bytes the KV disk cache keeps per model, e.g. 20GiB (least recently used out first)",
    "kv_disk_read_timeout": "seconds a request waits for blocks read from the KV disk cache; past it the disk is "
                            "taken as not answering, the cache turns off and the prefix is computed",
    "dtype": "weights' dtype: auto is float32 on MLX's CPU backend, the checkpoint's own on a GPU",
    "seed": "seed of the sampling of requests that give none",
    "speculative_config": "JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; methods "
                          "ngram, draft_model (with \"model\"), mtp (the checkpoint's MTP layer, or with \"model\" "
                          "a Gemma 4 assistant) "
                          "(default: no speculation)",
    "metrics_prefix": "metric name prefix: vllm makes dashboards written for vLLM work unchanged",
    "metrics_host": "address of the engine's /metrics",
    "host": "address the HTTP server listens on",
    "port": "HTTP port of the OpenAI/Anthropic-compatible API",
    "disable_log_stats": "no periodic stats line (throughput, running/waiting, KV usage) in the engine's log",
    "enable_log_requests": "one access line per request in the gateway's log (id, app, route, status, tokens, "
                           "TTFT, duration)",
    "gpu_memory_utilization": "fraction of device memory the engine may use",
    "kv_cache_memory": "KV pool size in bytes (overrides the fraction)",
    "num_kv_blocks": "KV pool size in blocks (overrides both)",
    "attention_backend": "paged attention implementation: auto, reference, host (numpy, CPU), metal, cuda",
    "async_scheduling": "schedule and build each step while the device runs the one before (default: on for "
                        "a GPU, off on the CPU, where attention reads each layer's inputs on the host)",
    "encode_thread": "with async scheduling, MLX encodes each step's graph into kernel launches on a thread of "
                     "its own while the next step is built (default: on for CUDA, off for Metal, where it is "
                     "not yet measured, and the CPU)",
    "compile_decode": "replay decode steps from a graph compiled once per batch shape instead of building "
                      "the model's graph in Python each step (default: on for a GPU, off on the CPU)",
    "pipeline_parallel_size": "ranks the model's layers are split over, each holding only its layers' weights "
                              "and KV (started on this machine, or by mlx.launch across machines)",
    "pipeline_split": "layers per rank, rank 0 first (rank 0 runs the last layers; default: an even split)",
    "tensor_parallel_size": "ranks each layer's heads and MLP are split over (families whose mlx_lm model can "
                            "shard; the KV heads must divide evenly)",
    "pipeline_batches": "scheduler batches in flight down a pipeline at once, each with its own requests "
                        "(vLLM's virtual engines; default: one per pipeline rank; 1: one at a time)",
    "pipeline_timeout": "seconds a step may wait on the other pipeline ranks before the engine stops",
    "task": "what the model serves: generate, embed (/v1/embeddings, /pooling), score (/v1/score, /rerank "
            "from the yes/no logits), auto (embed for an encoder folder, else generate)",
    "score_tokens": "for --task score: the 'no,yes' tokens whose last-position logits give P(yes)",
    "engine_endpoint": "ZeroMQ endpoint of the engine (default: an ipc socket in the runtime dir)",
    "model_endpoints": "several engines, one model each, as NAME=ENDPOINT; a request goes to its model's "
                       "(default: the one engine at --engine-endpoint)",
    "model_load_timeout": "seconds a request waits for its model's engine to start (serve --keep-alive)",
    "models_file": "TOML or JSON file of models to serve, each with its own engine flags: [[models]] "
                   "model = ..., max_model_len = ..., kv_cache_memory = ... (default: none)",
    "keep_alive": "start each model's engine on its first request, and stop it after this many seconds "
                  "without one, within --gpu-memory-utilization of the machine's memory for the whole set "
                  "(default: every engine runs from the start)",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/* (default: none, or the keys of `mlxd keys`)",
    "api_key_file": "like --api-key, the key read from this file (kept off command lines)",
    "chat_template": "Jinja chat template, or a file holding one (default: the model's)",
    "gateway_timeout": "seconds of silence after which a gateway's requests are aborted",
    "shutdown_timeout": "seconds in-flight requests get to finish on SIGTERM",
    "metrics_port": "serve the engine's Prometheus /metrics on this port (0: any free port; default: not served)",
    "engine_timeout": "seconds of silence after which the engine is declared dead",
    "sse_keepalive": "seconds between keep-alive comments on an idle stream",
    "allowed_origins": "browser origins allowed to call the API, or '*' (default: none; requests with Origin refused)",
    "allowed_hosts": "Host names answered beyond loopback names, IP literals and --host, or '*' (DNS rebinding)",
    "trust_request_chat_template": "render chat templates sent in requests (default: refused)",
    "limit_mm_per_prompt": "most images in one prompt, as vLLM: '{\"image\": 2}' (default: 4)",
    "allowed_media_domains": "hosts image URLs may be fetched from (default: any)",
    "allowed_local_media_path": "folder whose files may be sent as file: image URLs (default: none)",
    "media_fetch_timeout": "seconds to fetch an image URL",
    "media_max_bytes": "largest image a URL may return, in bytes",
    "media_max_redirects": "most redirects when fetching an image URL",
    "media_max_pixels": "largest image, in pixels (width x height)",
    "request_timeout": "seconds a client has to send its request head, and may pause within its body",
    "generation_config": "sampling defaults for omitted fields: auto (the model's generation_config.json), "
                         "vllm (none), or a folder holding one",
    "override_generation_config": "JSON object over those defaults, e.g. '{\"max_new_tokens\": 512}' "
                                  "(caps every request's max_tokens)",
    "enable_auto_tool_choice": "let the model call tools by itself (tool_choice auto); needs --tool-call-parser",
    "tool_call_parser": "the model's tool-call format, for reading calls and for required/named tool choice; "
                        "auto: the one its chat template writes (default: none; tool choice then follows "
                        "the template, else hermes)",
    "reasoning_parser": "split the model's reasoning (<think>...</think>, Gemma 4's thought channel, [THINK], "
                        "harmony's analysis, split by default) into the message's reasoning field; auto: as its "
                        "chat template writes it",
    "keys_file": "per-app API keys made by `mlxd keys add` (default: keys.json in the config dir)",
    "curve_keys": "directory of CurveZMQ keys (`mlxd keys curve`); needed for TCP beyond loopback",
    "enable_lora": "serve LoRA adapters over the base model; a request's model names its adapter",
    "lora_modules": "adapters served from the start: name=path, or vLLM's JSON '{\"name\": ..., \"path\": ...}' "
                    "(mlx_lm or PEFT adapter directories)",
    "max_loras": "LoRA adapters resident at once (the distinct adapters of one batch); others wait, LRU evicted",
    "max_lora_rank": "largest LoRA rank served (slots are sized for it)",
    "max_cpu_loras": "LoRA adapters kept in host memory (LRU, counted by the memory guard where host and device "
                     "share it); others are read again from disk when they next take a slot (default: --max-loras)",
    "enable_runtime_lora_updating": "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
}

# Fields whose values are a closed set: argparse refuses others and --help lists them.
CHOICES = {
    "attention_backend": ATTENTION_BACKENDS,
    "dtype": DTYPES,
    "task": ENGINE_TASKS,
    "metrics_prefix": ("mlxd", "vllm"),
}

# vLLM's short spellings.
ALIASES = {"pipeline_parallel_size": "-pp", "tensor_parallel_size": "-tp"}

# Sizes vLLM parses with its human_readable_int: 32k is 32000, 32K is 32768.
HUMAN_INTS = ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "max_waiting_requests",
              "kv_cache_memory", "num_kv_blocks", "kv_disk_budget")

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """An int, or a number with a suffix as vLLM reads it: k/m/g/t are powers of 1000 and take
    decimals (25.6k is 25600), K/M/G/T powers of 1024 and do not (20GiB is 20G)."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])(?:(?<=[KMGT])iB)?", value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"decimals are not allowed with binary suffixes like {suffix}; "
                                         f"did you mean {number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]


def _default_of(f):
    return f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default


def _help(f) -> str | None:
    text = HELP.get(f.name)
    if text is None or "default" in text:
        return text
    default = _default_of(f)
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif default in (None, []):
        shown = "none"
    else:
        shown = str(default)
    # argparse formats help with %: a literal percent sign must be doubled.
    return f"{text} (default: {shown})".replace("%", "%%")


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
        flags = ["--" + f.name.replace("_", "-"), *([ALIASES[f.name]] if f.name in ALIASES else [])]
        tp, is_list = _base_type(hints[f.name])
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=_help(f))
        if f.name in CHOICES:
            kw["choices"] = CHOICES[f.name]
        if tp is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif is_list:
            parser.add_argument(*flags, type=tp, nargs="*", **kw)
        else:
            parser.add_argument(*flags, type=human_readable_int if f.name in HUMAN_INTS else tp, **kw)


def build_config(struct: type, ns: argparse.Namespace, **fields):
    """``struct`` from the parsed flags that name its fields (the others keep their defaults), and
    ``fields``, which the caller sets over them."""
    names = {f.name for f in msgspec.structs.fields(struct)}
    return struct(**{**{k: v for k, v in vars(ns).items() if k in names}, **fields})


def engine_daemon(ns: argparse.Namespace) -> DaemonConfig:
    """The engine's daemon settings of `mlxd serve` or of a service, its endpoint written out in full
    (an unset ``--engine-endpoint`` is absent from ``ns``), so that the gateway beside it, and a
    service manager whatever environment it gives them, agree on it."""
    from mlxd.shared.paths import default_engine_endpoint

    return build_config(DaemonConfig, ns, engine_endpoint=vars(ns).get("engine_endpoint") or default_engine_endpoint())


def gateway_beside(ns: argparse.Namespace, daemon: DaemonConfig, **fields) -> GatewayConfig:
    """The gateway that `mlxd serve` runs, or a service installs, beside its engine: on the engine's
    endpoint, with its CurveZMQ keys and its shutdown timeout."""
    return build_config(GatewayConfig, ns, engine_endpoint=daemon.engine_endpoint, curve_keys=daemon.curve_keys,
                        shutdown_timeout=daemon.shutdown_timeout, **fields)


def to_flags(obj, skip=()) -> list[str]:
    """The flags that rebuild ``obj`` (fields left at their default are omitted)."""
    out = []
    for f in msgspec.structs.fields(type(obj)):
        v = getattr(obj, f.name)
        # An empty list equals its default_factory's: left out, not written as a bare `--flag`.
        if f.name in skip or v == _default_of(f) or v is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, list):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out
