"""The KV cache: a block pool, KV groups of each layer kind, and the manager that composes them.

- ``group``: the contract of a group and its ``Block``; ``full_attention`` (with
  the block pool, fixed-size blocks with reference counts, chained hashes and LRU
  eviction, and the paged K/V arrays the paged kinds share), ``sliding_window``,
  ``recurrent_state``: the kinds;
- ``manager``: ``KVCacheManager``, what the scheduler, runner and memory guard see.
"""

from engined.kv.manager import KVCacheManager

__all__ = ["KVCacheManager"]
