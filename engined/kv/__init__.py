"""The KV cache: its groups, one module per layer kind, and the manager that composes them.

- ``manager``: ``KVCacheManager``, the groups seen as one, which the scheduler allocates through;
- ``group``: the contract of a group and its ``Block``;
- ``full_attention`` (with the block pool, fixed-size blocks with reference
  counts, chained hashes and LRU eviction, and the paged K/V arrays the paged
  kinds share), ``sliding_window``, ``recurrent_state``, ``mtp_layer``: the kinds.
"""
