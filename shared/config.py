"""The one definition of every engine setting; CLI flags map 1:1 onto these fields (vLLM's names)."""

from __future__ import annotations

import msgspec

from shared.errors import InvalidRequestError


class EngineConfig(msgspec.Struct, kw_only=True):
    # Model path, GGUF file, mlx_lm directory or Hugging Face repo id; "" serves the embedded SmolLM2.
    model: str = ""
    served_model_name: str | None = None
    # None: the model's own context length.
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
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
    # "auto": float32 on MLX's CPU backend, the checkpoint's own (quantized) weights on a GPU.
    dtype: str = "auto"
    seed: int = 0
    # Metric name prefix: "mlxd", or "vllm" for dashboards written for vLLM.
    metrics_prefix: str = "mlxd"

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting_requests")
        for name in positive:
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be positive", param=name)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError("max_model_len must be positive", param="max_model_len")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(
                "gpu_memory_utilization must be in (0, 1]", param="gpu_memory_utilization"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError("num_kv_blocks must be positive", param="num_kv_blocks")
        if self.metrics_prefix not in ("mlxd", "vllm"):
            raise InvalidRequestError("metrics_prefix must be 'mlxd' or 'vllm'", param="metrics_prefix")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "quantized"):
            raise InvalidRequestError(f"unknown dtype {self.dtype!r}", param="dtype")
