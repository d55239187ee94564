"""Which runner and KV manager a model needs, from what its layers are.

- plain: every layer full attention, one paged K/V pool;
- hybrid: linear-attention layers too (``state_slots``): per-request state slots;
- windowed: sliding-window and full-attention layers mixed (``window_kv``): the
  window layers' K/V in a pool of their own that holds only what is in view.
"""

from __future__ import annotations

import mlx.core as mx

from engined import attention
from engined.kv_manager import KVCacheManager
from engined.runner import ModelRunner
from engined.state_slots import HybridKVCacheManager, HybridModelRunner
from engined.window_kv import WindowedKVCacheManager, WindowRunner, window_pool_blocks
from shared.config import EngineConfig
from shared.errors import InvalidRequestError, ModelLoadError


def _layers(model):
    return getattr(getattr(model, "model", model), "layers", ())


def has_linear_layers(model) -> bool:
    return any("linear_attn" in layer for layer in _layers(model))


def mixes_window_and_full_layers(model) -> bool:
    try:
        windows = [attention.layer_settings(model, i, layer, layer.self_attn).sliding_window
                   for i, layer in enumerate(_layers(model)) if "self_attn" in layer]
    except ModelLoadError:
        return False  # install() reports what is unsupported
    return any(w is None for w in windows) and any(w is not None for w in windows)


def make_runner(model, config: EngineConfig, num_kv_heads: int, head_dim: int, dtype: mx.Dtype) -> ModelRunner:
    args = (model, config.block_size, num_kv_heads, head_dim, dtype)
    if has_linear_layers(model):
        if config.speculative is not None:
            raise InvalidRequestError(
                "speculative decoding is not supported for hybrid linear-attention models: a recurrent "
                "state cannot take rejected draft tokens back", param="speculative_config",
            )
        runner = HybridModelRunner(*args)
        runner.states.configure(config.max_num_seqs, config.max_num_seqs if config.enable_prefix_caching else 0)
        return runner
    if mixes_window_and_full_layers(model):
        runner = WindowRunner(*args)
        runner.num_window_blocks = window_pool_blocks(
            runner.window, config.block_size, config.max_num_seqs, config.max_num_batched_tokens)
        return runner
    return ModelRunner(*args)


def make_kv_manager(runner: ModelRunner, num_blocks: int, config: EngineConfig) -> KVCacheManager:
    caching = config.enable_prefix_caching
    if isinstance(runner, HybridModelRunner):
        return HybridKVCacheManager(num_blocks, config.block_size, caching, runner.states)
    if isinstance(runner, WindowRunner):
        runner.kv = WindowedKVCacheManager(num_blocks, runner.num_window_blocks, config.block_size, caching,
                                           runner.window)
        return runner.kv
    return KVCacheManager(num_blocks, config.block_size, caching)
