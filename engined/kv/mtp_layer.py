"""The K/V of a checkpoint's MTP layer (``engined.speculation.mtp``): paged like full attention, in the main pool.

The MTP layer attends over its own K/V at the target's positions, so its
arrays are indexed by the main pool's block ids: the block a request holds
for a position holds the MTP layer's K/V of that position too. It claims no
layer of the target; it follows the main pool as that grows and shrinks, and
is billed per block of it, so the memory guard sizes the pool for both.
"""

from __future__ import annotations

import mlx.core as mx

from mlxd.engined.kv.manager import PagedArrays
from mlxd.engined.kv.group import KVGroup
from mlxd.engined.model_layers import LayerSpec


class MTPLayerGroup(KVGroup):
    def __init__(self, spec: LayerSpec, block_size: int, dtype: mx.Dtype):
        self.layers = []  # none of the target's: the MTP layer runs in its own forward
        self.spec = spec
        # Created, resized and cut by the full-attention group, as a follower of its block ids.
        self.kv = PagedArrays([spec], block_size, dtype)

    @classmethod
    def claim(cls, specs, config, dtype):
        return None  # added by the MTP proposer (``KVCacheManager.add``), never claimed from the target

    @property
    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block

    def arrays(self) -> list[mx.array]:
        return self.kv.arrays()
