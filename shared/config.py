"""The one definition of every engine setting; CLI flags map 1:1 onto these fields (vLLM's names)."""

from __future__ import annotations

import msgspec

from mlxd.shared.errors import InvalidRequestError

# engined.kernels.BACKENDS, spelled out here because shared/ does not import the kernels (nor MLX).
ATTENTION_BACKENDS = ("auto", "reference", "host", "metal", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16", "quantized")
# What the engine serves: auto is embed for an encoder (BERT-like) folder, generate otherwise.
ENGINE_TASKS = ("auto", "generate", "embed", "score")


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``--speculative-config`` as vLLM spells it (a JSON object).

    ``method`` is "ngram" (prompt lookup), "draft_model" (a second, smaller
    model of the same tokenizer) or "mtp" (the checkpoint's own
    multi-token-prediction layer, or with a ``model``, a separate MTP drafter
    checkpoint: Gemma 4's assistant). Omitted, it is "draft_model" when a
    ``model`` is given, else "mtp", as vLLM infers it; the engine then refuses
    a checkpoint without MTP layers, and reads a Gemma 4 assistant given as a
    draft model as "mtp" (``engined.speculation.proposers.resolve``).
    """

    method: str | None = None
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "mtp"
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(
                f"speculative method {self.method!r} is not one of {', '.join(map(repr, SPECULATIVE_METHODS))}",
                param="speculative_config",
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequestError("num_speculative_tokens must be in [1, 16]", param="speculative_config")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequestError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max", param="speculative_config"
            )
        if (self.method == "draft_model" and self.model is None) or (self.method == "ngram" and self.model):
            raise InvalidRequestError(
                "method 'draft_model' needs a model, and 'ngram' takes none", param="speculative_config"
            )


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")


# Defaults that depend on the device. A GPU step costs the host about the same whatever its size
# (graph building and kernel launches: ~15 ms for an 8B model on the H200, bench/gpu_serving_results.md),
# so a GPU takes larger steps; its attention reads every layer's inputs on the CPU, where nothing
# would overlap, so only a GPU schedules asynchronously. The encode thread made every measured
# decode step faster on the H200 (1.3x at 1 stream, 1.5x at 16 and 64); nobody has measured it on
# a Mac, so Metal keeps one thread.
_GPU = dict(max_num_seqs=128, max_num_batched_tokens=8192, async_scheduling=True, compile_decode=True)
DEVICE_DEFAULTS = {
    "cpu": dict(max_num_seqs=32, max_num_batched_tokens=1024, async_scheduling=False, encode_thread=False,
                compile_decode=False),
    "metal": dict(_GPU, encode_thread=False),
    "cuda": dict(_GPU, encode_thread=True),
}


class EngineConfig(msgspec.Struct, kw_only=True):
    # Model path, GGUF file, mlx_lm directory or Hugging Face repo id; "" serves the embedded SmolLM2.
    model: str = ""
    served_model_name: str | None = None
    # None: the model's own context length.
    max_model_len: int | None = None
    # None: the device's default (DEVICE_DEFAULTS, filled in by ``for_device``).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # Requests queued beyond the running ones; past this, new requests are refused (HTTP 429).
    max_waiting_requests: int = 256
    block_size: int = 16
    # Fraction of device memory (the OS's RAM on CPU) the engine may use in total.
    gpu_memory_utilization: float = 0.9
    # Explicit KV pool size in bytes; overrides the fraction.
    kv_cache_memory: int | None = None
    # Explicit KV pool size in blocks; overrides both (tests, benchmarks).
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # The prefix cache's disk tier (engined/kv/disk_tier.py): cached blocks evicted from the pool, and
    # those of the last sessions, kept in files under kv_cache_dir (None: kv/ in the user's cache dir),
    # at most kv_disk_budget bytes, and read back instead of recomputed, also after a restart.
    # Off until measured to pay (bench/kv_disk.py).
    kv_disk_cache: bool = False
    kv_cache_dir: str | None = None
    kv_disk_budget: int = 20 * 2**30
    # A read not back in this many seconds means the disk is not answering (a stalled network share, a
    # failing drive): the tier turns off and the waiting request computes its prefix instead.
    kv_disk_read_timeout: float = 30.0
    # "auto": float32 on MLX's CPU backend, the checkpoint's own (quantized) weights on a GPU.
    dtype: str = "auto"
    seed: int = 0
    # JSON, e.g. '{"method": "ngram", "num_speculative_tokens": 4}'; None: no speculation.
    speculative_config: str | None = None
    # Metric name prefix: "mlxd", or "vllm" for dashboards written for vLLM.
    metrics_prefix: str = "mlxd"
    # The paged attention implementation (kernels.BACKENDS): "auto" picks by device (Metal or
    # CUDA kernel on a GPU, numpy "host" path on the CPU); "reference" is the pure-MLX oracle.
    attention_backend: str = "auto"
    # Schedule and build step n+1 while the device runs step n, reading step n's tokens after.
    # None: the device's default (on for a GPU, off on MLX's CPU backend).
    async_scheduling: bool | None = None
    # With async scheduling: MLX encodes each step's graph on a thread of its own while the next is built.
    # None: the device's default (on for CUDA, off for Metal and the CPU).
    encode_thread: bool | None = None
    # Decode steps replayed from a graph compiled once per shape instead of built layer by layer
    # (engined/fastpath/compiled_decode.py). None: the device's default (on for a GPU, off on the CPU).
    compile_decode: bool | None = None
    # Ranks the model's layers are split over (engined/parallel/pipeline.py); each rank is a process, on
    # this machine or on others (mlx.launch), and holds only its layers' weights and KV.
    pipeline_parallel_size: int = 1
    # Layers per rank, rank 0 first (rank 0 runs the last layers); empty: an even split.
    pipeline_split: list[int] = []
    # Ranks each layer's heads and MLP are split over (mlx_lm's ``shard``), each with its share of
    # the weights and of the KV heads; not combined with a pipeline yet.
    tensor_parallel_size: int = 1
    # Scheduler batches in flight down a pipeline at once, each with its own requests (vLLM's
    # virtual engines); None: one per pipeline rank, so every rank has one to compute.
    pipeline_batches: int | None = None
    # Seconds a forward may wait on the other ranks before the engine gives up on them.
    pipeline_timeout: float = 120.0
    # generate: text; embed: last-token pooled, L2-normalised vectors (Qwen3-Embedding) or an
    # encoder's sentence-transformers pooling; score: P(yes) from the last position's logits of
    # the two ``score_tokens`` (Qwen3-Reranker); auto: embed for an encoder folder, else generate.
    task: str = "auto"
    # score: the tokens "no,yes" whose logits give the score, each one token of the vocabulary.
    score_tokens: str = "no,yes"
    # LoRA adapters (vLLM's flags): off unless enabled; adapters served from the start, each
    # "name=path" or vLLM's JSON '{"name": ..., "path": ...}'; how many sit in device slots at once
    # (the distinct adapters of one batch); the largest rank served (slots are sized for it); how
    # many keep a host copy (LRU; None: max_loras, as vLLM), the others are read again from disk.
    enable_lora: bool = False
    lora_modules: list[str] = []
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting_requests")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be positive", param=name)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError("max_model_len must be positive", param="max_model_len")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(
                "gpu_memory_utilization must be in (0, 1]", param="gpu_memory_utilization"
            )
        if self.kv_disk_read_timeout <= 0:
            raise InvalidRequestError("kv_disk_read_timeout must be positive", param="kv_disk_read_timeout")
        if self.kv_disk_budget < 1:
            raise InvalidRequestError("kv_disk_budget must be positive", param="kv_disk_budget")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError("num_kv_blocks must be positive", param="num_kv_blocks")
        if self.speculative_config is not None:
            self.speculative  # parse now so a bad JSON object fails at start-up
        if self.metrics_prefix not in ("mlxd", "vllm"):
            raise InvalidRequestError("metrics_prefix must be 'mlxd' or 'vllm'", param="metrics_prefix")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequestError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}",
                                      param="attention_backend")
        for name in ("pipeline_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be positive", param=name)
        if self.enable_lora and self.num_ranks > 1:
            raise InvalidRequestError("LoRA adapters cannot be served over several ranks yet",
                                      param="enable_lora")
        if self.pipeline_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise InvalidRequestError("pipeline and tensor parallelism cannot be combined yet; pick one",
                                      param="tensor_parallel_size")
        if self.pipeline_split and len(self.pipeline_split) != self.pipeline_parallel_size:
            raise InvalidRequestError(f"pipeline_split names {len(self.pipeline_split)} ranks; "
                                      f"pipeline_parallel_size is {self.pipeline_parallel_size}",
                                      param="pipeline_split")
        if self.pipeline_batches is not None and self.pipeline_batches < 1:
            raise InvalidRequestError("pipeline_batches must be positive", param="pipeline_batches")
        if self.pipeline_timeout <= 0:
            raise InvalidRequestError("pipeline_timeout must be positive", param="pipeline_timeout")
        if self.task not in ENGINE_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(ENGINE_TASKS)}", param="task")
        if len(self.score_tokens.split(",")) != 2 or not all(self.score_tokens.split(",")):
            raise InvalidRequestError("score_tokens must be two tokens, 'no,yes'", param="score_tokens")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"unknown dtype {self.dtype!r}", param="dtype")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise InvalidRequestError("max_loras and max_lora_rank must be positive", param="max_loras")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
                                      param="max_cpu_loras")
        if self.lora_modules and not self.enable_lora:
            raise InvalidRequestError("--lora-modules needs --enable-lora", param="lora_modules")
        self.lora_adapters  # parse now so a bad entry fails at start-up

    @property
    def lora_adapters(self) -> list[tuple[str, str]]:
        """``lora_modules`` as (name, path) pairs, in order; names are unique."""
        pairs = []
        for entry in self.lora_modules:
            if entry.lstrip().startswith("{"):
                try:
                    obj = msgspec.json.decode(entry)
                except msgspec.DecodeError as e:
                    raise InvalidRequestError(f"--lora-modules: {entry!r} is not JSON: {e}",
                                              param="lora_modules") from None
                if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                        and isinstance(obj.get("path"), str)):
                    raise InvalidRequestError(f"--lora-modules: {entry!r} needs string fields name and path",
                                              param="lora_modules")
                pairs.append((obj["name"], obj["path"]))
            else:
                name, eq, path = entry.partition("=")
                if not eq or not name or not path:
                    raise InvalidRequestError(f"--lora-modules: {entry!r} is not name=path", param="lora_modules")
                pairs.append((name, path))
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise InvalidRequestError("--lora-modules: an adapter name is given twice", param="lora_modules")
        return pairs

    def for_device(self, device: str) -> "EngineConfig":
        """This config with the settings left to the device (None) filled in from DEVICE_DEFAULTS:
        ``device`` one of its keys."""
        defaults = DEVICE_DEFAULTS[device]
        return msgspec.structs.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    @property
    def num_ranks(self) -> int:
        """Processes the model runs over (``engined/parallel/pipeline.py``); 1: this one alone."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        try:
            return msgspec.json.decode(self.speculative_config, type=SpeculativeConfig)
        except msgspec.ValidationError as e:
            raise InvalidRequestError(f"--speculative-config: {e}", param="speculative_config") from e
        except msgspec.DecodeError as e:
            raise InvalidRequestError(f"--speculative-config is not JSON: {e}", param="speculative_config") from e
