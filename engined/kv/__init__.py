"""The KV cache: a block pool, KV groups of each layer kind, and the manager that composes them.

- ``block_pool``: fixed-size blocks, reference counts, chained hashes, LRU eviction;
- ``group``: the contract of a group; ``full_attention`` (with the paged K/V
  arrays the paged kinds share), ``sliding_window``, ``recurrent_state``: the kinds;
- ``manager``: ``KVCacheManager``, what the scheduler, runner and memory guard see.
"""

from engined.kv.manager import KVCacheManager

__all__ = ["KVCacheManager"]
