"""The KV cache: its groups, one module per layer kind, and the manager that composes them.

- ``manager``: ``KVCacheManager``, the groups seen as one, which the scheduler allocates through, with
  its main group, full attention's (the block pool, fixed-size blocks with reference counts, chained
  hashes and LRU eviction, and the paged K/V arrays the paged kinds share);
- ``group``: the contract of a group and its ``Block``;
- ``sliding_window``, ``recurrent_state``, ``mtp_layer``: the other kinds;
- ``kinds``: which kind claims which of a model's layers, and the manager built from them at start-up;
- ``disk_tier`` (with ``disk_store``, ``disk_format``, ``disk_parts``): the disk tier under the groups.
"""
