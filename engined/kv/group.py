"""The contract every KV group keeps; ``manager.KVCacheManager`` composes them.

A group owns one kind of per-layer cache for the layers it claims: its sizes,
its arrays, its per-request tables, how far a cached prefix can serve it, and
its part of allocate / commit / free. The defaults here are a group that needs
nothing per request; a kind overrides what it keeps.

A ``Block`` is what a group's tables hold and a cached prefix is made of; its
pool (``manager.BlockPool``) hands it out.
"""

from __future__ import annotations

import mlx.core as mx

from mlxd.engined.model_layers import LayerSpec
from mlxd.engined.request import Request
from mlxd.shared.config import EngineConfig


class Block:
    """One block of a pool: its id, the references held to it, and the chained hash it is cached under."""

    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


class KVGroup:
    layers: list[int]  # the model layers whose ``cache`` this group provides
    # Whether rejected draft tokens can be taken back: paged K/V is overwritten later; a recurrent
    # state needs its window slots (``recurrent_state``).
    can_rewind = True

    @classmethod
    def claim(cls, specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype) -> "KVGroup | None":
        """A group over the layers of ``specs`` (those not claimed yet) that are of this kind, or None."""
        raise NotImplementedError

    # -- memory ------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """Bytes billed per block of the main pool (the pool the memory guard sizes)."""
        return 0

    @property
    def fixed_bytes(self) -> int:
        """Bytes of pools sized by configuration, not by the budget (set aside before the main pool)."""
        return 0

    def create(self, num_blocks: int, record_evictions: bool = False) -> None:
        """(Re)create the arrays for a main pool of ``num_blocks`` blocks, all free; 0 drops them.
        ``record_evictions``: list what leaves the group's prefix cache in ``evicted``, for the disk
        tier (``disk_tier``) to take."""

    def arrays(self) -> list[mx.array]:
        """The arrays a forward writes, to evaluate with its outputs."""
        return []

    # -- per request ---------------------------------------------------------------------------

    def prefix_blocks(self, req: Request, num_blocks: int) -> int:
        """How many of the first ``num_blocks`` cached blocks (hashes computed) this group can resume from."""
        return num_blocks

    def can_allocate(self, req: Request, num_new_tokens: int, prefix: list[Block]) -> bool:
        return True

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[Block]) -> None:
        """Hold room for ``num_new_tokens`` after the computed tokens and ``prefix``; ``can_allocate`` said yes."""

    def commit(self, req: Request) -> None:
        """After a step advanced ``req.num_computed_tokens``: cache what is complete, drop what is out of use."""

    def free(self, req: Request) -> None:
        """The request finished, was aborted or preempted: give back everything it holds."""

    # -- per step ------------------------------------------------------------------------------

    def step(self, scheduled: list[tuple[Request, int]], query_lens: list[int], seq_lens: list[int],
             caches: list) -> None:
        """Put this step's object for each of the group's layers into the model's ``caches`` list."""
