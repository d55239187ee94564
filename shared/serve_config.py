"""Settings of the two processes beyond the engine's own (EngineConfig): the wire and HTTP.

CLI flags map 1:1 onto these fields, like EngineConfig's.
"""

from __future__ import annotations

import json

import msgspec

from mlxd.shared.errors import InvalidRequestError


class DaemonConfig(msgspec.Struct, kw_only=True):
    # None: ipc://<runtime dir>/engine.sock (shared.paths.default_engine_endpoint).
    engine_endpoint: str | None = None
    # A gateway silent this long is gone: its requests are aborted and their blocks freed.
    gateway_timeout: float = 10.0
    # On SIGTERM/SIGINT, in-flight requests get this long to finish before they are aborted.
    shutdown_timeout: float = 3.0
    # Prometheus /metrics of the engine on this port (None: not served; 0: any free port).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # Directory of CurveZMQ keys (`mlxd keys curve`): encrypts the engine's socket and lets in only
    # known gateways; required for TCP beyond loopback (shared/curve.py).
    curve_keys: str | None = None
    # vLLM's flag: no periodic stats line (throughput, running/waiting, KV usage) in the log.
    disable_log_stats: bool = False

    def __post_init__(self) -> None:
        if self.gateway_timeout <= 0:
            raise InvalidRequestError("gateway_timeout must be positive", param="gateway_timeout")
        if self.shutdown_timeout < 0:
            raise InvalidRequestError("shutdown_timeout must be >= 0", param="shutdown_timeout")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise InvalidRequestError("metrics_port must be in [0, 65536)", param="metrics_port")


class ModelSetConfig(msgspec.Struct, kw_only=True):
    """`mlxd serve` of several models (mlxd/model_set.py, mlxd/fleet.py)."""

    # A TOML or JSON file naming each model with its own engine settings.
    models_file: str | None = None
    # Start each model's engine on its first request, and stop one with no request for this many
    # seconds; None: every engine runs from the start.
    keep_alive: float | None = None

    def __post_init__(self) -> None:
        if self.keep_alive is not None and self.keep_alive <= 0:
            raise InvalidRequestError("keep_alive must be positive", param="keep_alive")


# Hugging Face generation_config keys that set sampling defaults → SamplingParams fields.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_sampling_keys(config: dict, where: str) -> dict:
    """The sampling keys of a generation config as SamplingParams fields, type-checked; others ignored."""
    out = {}
    for key, name in GENERATION_CONFIG_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError(f"{where}: {key} must be a number", param="generation_config")
        if name in ("top_k", "max_tokens"):
            if value != int(value):
                raise InvalidRequestError(f"{where}: {key} must be an integer", param="generation_config")
            value = int(value)
        out[name] = value
    if out.get("max_tokens") is not None and out["max_tokens"] < 1:
        raise InvalidRequestError(f"{where}: max_new_tokens must be at least 1", param="generation_config")
    return out


class GatewayConfig(msgspec.Struct, kw_only=True):
    engine_endpoint: str | None = None
    # Several engines, one model each: "NAME=ENDPOINT" (`mlxd serve MODEL MODEL ...` writes them); a
    # request is routed by its model. Empty: the one engine at engine_endpoint, its name from its READY.
    model_endpoints: list[str] = []
    # Under `mlxd serve --keep-alive`: how long a request waits for its model's engine to start.
    model_load_timeout: float = 300.0
    host: str = "127.0.0.1"
    port: int = 8000
    # Clients must send "Authorization: Bearer <api_key>" to /v1/* when set.
    api_key: str | None = None
    # The same, read from this file at start-up: keeps the key off command lines and unit files.
    api_key_file: str | None = None
    # Per-app keys (`mlxd keys add APP`); None: keys.json in the config dir. Once any app has
    # a key, every request must present one (or --api-key); requests carry their app to the engine.
    keys_file: str | None = None
    # The engine's CurveZMQ keys, as for the engine (DaemonConfig.curve_keys).
    curve_keys: str | None = None
    # A Jinja template, or the path of a file holding one; None: the model's own.
    chat_template: str | None = None
    # An engine silent this long (no PONG, no output) is declared hung. The engine
    # answers pings from its wire thread even while a long step runs; a killed
    # engine is noticed at once through the socket's disconnect instead.
    engine_timeout: float = 60.0
    # A comment line is sent on an SSE stream idle this long (a long prefill) so
    # that proxies and clients keep the connection.
    sse_keepalive: float = 5.0
    # On SIGTERM/SIGINT, open requests get this long to finish; then each ends with an error
    # (a JSON body, or an SSE error event and [DONE]). `serve` passes the engine's value.
    shutdown_timeout: float = 3.0
    # Browser origins allowed to call the API (CORS; "*": any); empty: requests that carry an
    # Origin header are refused, so that no web page can drive the local server.
    allowed_origins: list[str] = []
    # Host names the server answers to beyond loopback names, IP literals and --host ("*": any);
    # others are refused (DNS rebinding).
    allowed_hosts: list[str] = []
    # Render chat templates sent in requests (vLLM's flag); off, such requests are refused.
    trust_request_chat_template: bool = False
    # A client gets this long to send its request head, and may pause this long within its body;
    # past it the connection is closed (head) or the request answered 408 (body).
    request_timeout: float = 30.0
    # tool_choice "auto": the model's tool calls are read by --tool-call-parser.
    enable_auto_tool_choice: bool = False
    # The model's tool-call format: how calls are read, and the grammar of
    # tool_choice "required"/named (hermes when unset).
    tool_call_parser: str | None = None
    # Splits <think>…</think> into the message's "reasoning".
    reasoning_parser: str | None = None
    # Sampling defaults for fields a request omits: "auto" (the model's generation_config.json),
    # "vllm" (none), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # JSON object laid over those defaults, e.g. '{"max_new_tokens": 512, "temperature": 0.7}'.
    override_generation_config: str | None = None

    # vLLM's flag (off by default there too): one access line per request in the log.
    enable_log_requests: bool = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    enable_runtime_lora_updating: bool = False

    # Images in a prompt (gateway/media.py): vLLM's --limit-mm-per-prompt (a JSON object such as
    # '{"image": 2}'; None: 4 images), --allowed-media-domains (empty: any host) and
    # --allowed-local-media-path (None: no file: URLs); a fetched image's time, size and redirect
    # limits, and a decoded image's pixel limit.
    limit_mm_per_prompt: str | None = None
    allowed_media_domains: list[str] = []
    allowed_local_media_path: str | None = None
    media_fetch_timeout: float = 10.0
    media_max_bytes: int = 20 * 2**20
    media_max_redirects: int = 3
    media_max_pixels: int = 40_000_000

    @property
    def generation_override(self) -> dict:
        """``override_generation_config`` as SamplingParams fields; unknown keys are refused, not ignored."""
        text = self.override_generation_config
        if not text:
            return {}
        try:
            value = json.loads(text)
        except ValueError as e:
            raise InvalidRequestError(f"--override-generation-config is not JSON: {e}",
                                      param="override_generation_config") from None
        if not isinstance(value, dict):
            raise InvalidRequestError("--override-generation-config must be a JSON object",
                                      param="override_generation_config")
        unknown = sorted(set(value) - set(GENERATION_CONFIG_KEYS))
        if unknown:
            raise InvalidRequestError(f"--override-generation-config: unknown keys {unknown}; known: "
                                      f"{', '.join(GENERATION_CONFIG_KEYS)}", param="override_generation_config")
        return generation_sampling_keys(value, "--override-generation-config")

    @property
    def images_per_prompt(self) -> int:
        """``limit_mm_per_prompt``'s image count (vLLM's JSON object; other modalities are not taken)."""
        if self.limit_mm_per_prompt is None:
            return 4
        try:
            value = json.loads(self.limit_mm_per_prompt)
        except ValueError:
            value = None
        if not (isinstance(value, dict) and set(value) <= {"image"} and isinstance(value.get("image", 0), int)
                and value.get("image", 0) >= 0):
            raise InvalidRequestError("--limit-mm-per-prompt must be a JSON object such as '{\"image\": 2}'",
                                      param="limit_mm_per_prompt")
        return value.get("image", 0)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise InvalidRequestError("enable_auto_tool_choice needs a tool_call_parser", param="tool_call_parser")
        self.generation_override  # parse now so a bad JSON object fails at start-up
        self.images_per_prompt  # likewise
        if not 0 <= self.port < 65536:
            raise InvalidRequestError("port must be in [0, 65536)", param="port")
        if self.engine_timeout <= 0:
            raise InvalidRequestError("engine_timeout must be positive", param="engine_timeout")
        if self.shutdown_timeout < 0:
            raise InvalidRequestError("shutdown_timeout must be >= 0", param="shutdown_timeout")
        if self.api_key is not None and self.api_key_file is not None:
            raise InvalidRequestError("give --api-key or --api-key-file, not both", param="api_key_file")
        if self.request_timeout <= 0:
            raise InvalidRequestError("request_timeout must be positive", param="request_timeout")
        if self.sse_keepalive <= 0:
            raise InvalidRequestError("sse_keepalive must be positive", param="sse_keepalive")
        if self.model_load_timeout <= 0:
            raise InvalidRequestError("model_load_timeout must be positive", param="model_load_timeout")
        self.engines  # a malformed NAME=ENDPOINT fails at start-up

    @property
    def engines(self) -> list[tuple[str | None, str | None]]:
        """(model name, endpoint) of each engine; one (None, engine_endpoint) without model_endpoints."""
        if not self.model_endpoints:
            return [(None, self.engine_endpoint)]
        out = []
        for entry in self.model_endpoints:
            # Endpoints hold no "=", a model's name might.
            name, eq, endpoint = entry.rpartition("=")
            if not eq or not name or not endpoint:
                raise InvalidRequestError(f"--model-endpoints {entry!r}: expected NAME=ENDPOINT",
                                          param="model_endpoints")
            out.append((name, endpoint))
        names = [n for n, _ in out]
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"--model-endpoints names a model twice: {names}", param="model_endpoints")
        return out
