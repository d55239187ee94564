"""The kinds of KV group, and the manager a model's layers get (``build_manager``, once at start-up).

Each kind in ``KINDS`` claims the layers of its kind, in order; the full-attention group
(``manager.FullAttentionGroup``) then takes every attention layer left and comes first, its pool
bounding admission. A new kind is one file and a line in ``KINDS``. Under the groups, where the disk
tier is on (``--kv-disk-cache``), it gets one part per group (``disk_parts``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import mlx.core as mx

from mlxd.engined.kv.disk_parts import PagedPart, StatePart
from mlxd.engined.kv.disk_store import DiskStore
from mlxd.engined.kv.disk_tier import DiskTier
from mlxd.engined.kv.group import KVGroup
from mlxd.engined.kv.manager import FullAttentionGroup, KVCacheManager
from mlxd.engined.kv.recurrent_state import RecurrentStateGroup
from mlxd.engined.kv.sliding_window import SlidingWindowGroup
from mlxd.engined.model_layers import LayerSpec
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ModelLoadError
from mlxd.shared.paths import cache_dir

log = logging.getLogger("mlxd.engine")

# Kinds that claim layers before the full-attention group takes every attention layer left.
KINDS: tuple[type[KVGroup], ...] = (SlidingWindowGroup, RecurrentStateGroup)


def build_manager(specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype,
                  settle: Callable[[], None] | None = None, weights: str | None = None) -> KVCacheManager:
    """The groups for a model's layers (``model_layers.read_layers``), as one manager; arrays come with its
    ``create``. ``settle`` is called before the main pool's arrays are resized (``FullAttentionGroup``).
    ``weights``: the weights' fingerprint, given where the disk tier may serve the engine."""
    others, left = [], list(specs)
    for kind in KINDS:
        group = kind.claim(left, config, dtype)
        if group is not None:
            others.append(group)
            left = [s for s in left if s.index not in group.layers]
    main = FullAttentionGroup.claim(left, config, dtype, settle)
    # A pipeline rank may hold linear layers only; the pool's blocks then cost it nothing.
    if not main.layers and config.pipeline_parallel_size == 1:
        raise ModelLoadError("the model has no attention layer: the paged runner needs at least one")
    return KVCacheManager(main, others, len(specs), _disk_tier(main, others, config, dtype, weights))


def _disk_tier(main: FullAttentionGroup, others: list[KVGroup], config: EngineConfig, dtype: mx.Dtype,
               weights: str | None) -> DiskTier | None:
    """The disk tier under the groups (``disk_tier``), where it is on; one part per group."""
    if not (config.kv_disk_cache and config.enable_prefix_caching and weights is not None and main.layers):
        return None
    parts = [PagedPart(main, main.take_blocks)]
    for g in others:
        if isinstance(g, SlidingWindowGroup):
            parts.append(PagedPart(g))
        elif isinstance(g, RecurrentStateGroup):
            parts.append(StatePart(g))
        else:
            log.info("KV disk cache off: %s is not written to disk", type(g).__name__)
            return None
    # Everything besides the token chain that an entry's content depends on: its namespace.
    identity = {"format": 1, "weights": weights, "dtype": str(dtype), "block_size": config.block_size,
                "parts": [[p.suffix.decode(), p.names, [[list(shape), width] for shape, width in p.layout]]
                          for p in parts],
                "layers": [g.layers for g in (main, *others)], "aliases": main.kv.aliases}
    root = config.kv_cache_dir or os.path.join(cache_dir(), "kv")
    return DiskTier(DiskStore(root, identity, config.kv_disk_budget), parts, config.block_size, main.settle,
                    config.kv_disk_read_timeout)
