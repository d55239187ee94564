"""Per-request state of hybrid models' linear-attention layers, in fixed slots the engine manages.

A hybrid model (Qwen3-Next, Qwen3.5: gated delta nets mixed with full
attention) keeps, besides paged K/V for its attention layers, a fixed-size
state per request for each linear layer. ``RecurrentStateGroup`` holds those
states in one preallocated pool per layer (``[num_slots, ...]``), counted by the memory
guard: ``max_num_seqs`` live slots, one per running request, taken the first
time it is scheduled and given back when it finishes, is aborted or preempted;
plus, with prefix caching, snapshot slots.

Prefix caching ("align" mode): a recurrent state cannot be rebuilt from cached
K/V, so the state at a block boundary is saved (a snapshot keyed by that
block's hash) when a step crosses it: the last boundary each step reaches, and
the boundary that ends a request's longest reusable prefix. A prefill chunk
that crosses such a boundary is split there inside the linear layers, so no
scheduling change is needed. A cached prefix is used only up to its last block
with a snapshot; a request resuming from it starts from a copy of that state.
Snapshots are evicted least recently used.

Speculative decoding: a recurrent state cannot take rejected draft tokens
back, so each verification window (the last token and its ``k`` drafts)
runs through the linear layers as ``k + 1`` copies, copy ``j`` masked after
position ``j`` (mlx_lm's right padding), all windows of the step in one run:
copy ``j``'s final state is the state after position ``j``. The first ``k``
go to the request's window slots (``k`` per live slot, fixed, billed with the
pool), the last back to its live slot. Once the verifier's result is known (``commit``), the live
slot takes the state of the last accepted position (nothing to do when every
draft was accepted); the copy runs, lazily, at the start of the next step.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import numpy as np

from mlxd.engined.kv.manager import extend_hashes
from mlxd.engined.kv.group import KVGroup
from mlxd.engined.linear_attention import StateGroup, StatePlan, state_shapes
from mlxd.engined.model_layers import LayerSpec
from mlxd.engined.request import Request
from mlxd.shared.config import EngineConfig


class StateLayerStep:
    """What one linear layer gets as its ``cache`` for one forward: the step's plan and its slot arrays."""

    __slots__ = ("plan", "arrays")

    def __init__(self, plan: StatePlan, arrays: list[mx.array]):
        self.plan = plan
        self.arrays = arrays

    # As ``PagedLayerStep.keys``: where mlx_lm's pipelined models tie a rank's send to its last layer.
    @property
    def keys(self) -> mx.array:
        return self.arrays[0]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self.arrays[0] = value


class RecurrentStateGroup(KVGroup):
    def __init__(self, specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype):
        self.layers = [s.index for s in specs]
        self.layer_shapes = [state_shapes(s.linear, s.hidden_size, dtype) for s in specs]
        self.block_size = config.block_size
        self.num_live = config.max_num_seqs
        self.num_snapshots = config.max_num_seqs if config.enable_prefix_caching else 0
        spec = config.speculative
        # Window slots per live slot: the states after each draft position but the last.
        self.window = spec.num_speculative_tokens if spec is not None else 0
        # Without window slots a rejected draft could not be taken back out of the state.
        self.can_rewind = self.window > 0
        self.states: list[list[mx.array]] = [[] for _ in specs]
        self.evicted: list[tuple[bytes, list[mx.array]]] | None = None
        self._reset(0)

    @classmethod
    def claim(cls, specs: list[LayerSpec], config: EngineConfig, dtype: mx.Dtype) -> "RecurrentStateGroup | None":
        linear = [s for s in specs if s.linear is not None]
        return cls(linear, config, dtype) if linear else None

    @property
    def fixed_bytes(self) -> int:
        return self.nbytes

    def create(self, num_blocks: int, record_evictions: bool = False) -> None:
        """(Re)create the pool, every slot free and zeroed; ``num_blocks == 0`` drops it. With
        ``record_evictions``, each snapshot evicted is listed in ``evicted`` as (hash, its arrays taken
        before the slot is reused: lazy, evaluated by whoever takes them)."""
        self.evicted = [] if record_evictions else None
        total = self.num_live * (1 + self.window) + self.num_snapshots if num_blocks else 0
        self.states = [[mx.zeros((total, *shape), dtype=dtype) for shape, dtype in layer]
                       for layer in self.layer_shapes]
        mx.eval(self.states)
        self._reset(total)

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.states for a in layer]

    def prefix_blocks(self, req: Request, num_blocks: int) -> int:
        """Back to the last block whose state was saved (a recurrent state is not rebuilt from K/V)."""
        n = num_blocks
        while n and req.block_hashes[n - 1] not in self.snapshots:
            n -= 1
        return n

    def _reset(self, total: int) -> None:
        self.live: dict[str, int] = {}
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, oldest use first
        self.pending: dict[str, list[tuple[int, int]]] = {}  # request -> [(boundary, slot)] taken, not yet keyed
        # Slots: live ones, then snapshots, then ``window`` window slots per live slot.
        live = min(total, self.num_live)
        snap_end = min(total, self.num_live + self.num_snapshots)
        self.free_live = list(range(live - 1, -1, -1))
        self.free_snapshots = list(range(snap_end - 1, live - 1, -1))
        self.windows: dict[str, tuple[int, int]] = {}  # request -> (first position, length) of its window
        self.restores: dict[int, int] = {}  # live slot -> window slot it takes at the next step

    def _window_slot(self, live: int, j: int) -> int:
        """Where the state after window position ``j`` of the request in slot ``live`` is kept."""
        return self.num_live + self.num_snapshots + live * self.window + j

    @property
    def bytes_per_slot(self) -> int:
        return sum(int(np.prod(shape)) * dtype.size for layer in self.layer_shapes for shape, dtype in layer)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool once allocated (what the memory guard sets aside)."""
        return (self.num_live * (1 + self.window) + self.num_snapshots) * self.bytes_per_slot

    # -- per step -------------------------------------------------------------------------------

    def step(self, scheduled, query_lens, seq_lens, caches) -> None:
        """Give new requests their slots (zeroed, or a copy of their prefix's snapshot), then plan the groups."""
        bs = self.block_size
        zero, copy_src, copy_dst = [], [], []
        if self.restores:  # windows verified last step: each live state goes back to its last accepted position
            copy_dst, copy_src = list(self.restores), list(self.restores.values())
            self.restores = {}
        for req, _ in scheduled:
            if req.request_id in self.live:
                continue
            if not self.free_live:
                raise RuntimeError("more running requests than state slots (max_num_seqs)")
            slot = self.free_live.pop()
            self.live[req.request_id] = slot
            done = req.num_computed_tokens
            if done == 0:
                zero.append(slot)
            else:
                assert done % bs == 0, "a cached prefix for a hybrid model must end on a block boundary"
                key = req.block_hashes[done // bs - 1]
                copy_src.append(self.snapshots[key])  # cached_prefix only offers prefixes with a snapshot
                copy_dst.append(slot)
                self.snapshots.move_to_end(key)
        if zero or copy_dst:
            for layer in self.states:
                for a in layer:
                    if copy_dst:
                        a[mx.array(copy_dst)] = a[mx.array(copy_src)]
                    if zero:
                        a[mx.array(zero)] = mx.zeros((len(zero), *a.shape[1:]), dtype=a.dtype)
        plan = self._plan(scheduled)
        for layer, arrays in zip(self.layers, self.states):
            caches[layer] = StateLayerStep(plan, arrays)

    def _snapshot_slot(self) -> int | None:
        if self.free_snapshots:
            return self.free_snapshots.pop()
        if self.snapshots:
            key, slot = self.snapshots.popitem(last=False)
            if self.evicted is not None:
                self.evicted.append((key, [a[slot] for layer in self.states for a in layer]))
            return slot
        return None

    def restore(self, key: bytes, arrays: list[mx.array]) -> bool:
        """Keep ``arrays`` (a slot's worth, one per state array in ``arrays()`` order) as the snapshot
        at block ``key`` (read back by the disk tier); False if there is no snapshot slot."""
        slot = self._snapshot_slot()
        if slot is None:
            return False
        values = iter(arrays)
        for layer in self.states:
            for a in layer:
                a[slot] = next(values)
        self.snapshots[key] = slot
        return True

    def _boundaries(self, req: Request, start: int, end: int) -> list[int]:
        """Block boundaries in ``(start, end]`` whose state is worth keeping (see the module doc)."""
        if not self.num_snapshots:
            return []
        bs = self.block_size
        marks = {end // bs * bs, (req.num_tokens - 1) // bs * bs}
        return sorted(p for p in marks if start < p <= end and p > 0)

    def _take(self, req: Request, boundary: int) -> int | None:
        slot = self._snapshot_slot()
        if slot is not None:
            self.pending.setdefault(req.request_id, []).append((boundary, slot))
        return slot

    def _plan(self, scheduled: list[tuple[Request, int]]) -> StatePlan:
        lens = np.array([n for _, n in scheduled], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lens)])
        groups = []
        ids = []  # per row of the concatenated group outputs, the packed row it is (-1: an extra row)
        # A window (a token and its drafts) is not a prefill: its states after each position are kept.
        windows = [b for b in np.flatnonzero(lens > 1)
                   if scheduled[b][0].num_computed_tokens + lens[b] > scheduled[b][0].num_tokens_with_placeholders]
        decode = np.flatnonzero(lens == 1)
        if len(decode):
            src, dst = [], []
            for i, b in enumerate(decode):
                req = scheduled[b][0]
                for p in self._boundaries(req, req.num_computed_tokens, req.num_computed_tokens + 1):
                    if (slot := self._take(req, p)) is not None:
                        src.append(i)
                        dst.append(slot)
            groups.append(StateGroup(
                rows=mx.array(cu[decode].astype(np.int32)),
                slots=mx.array([self.live[scheduled[b][0].request_id] for b in decode]),
                batch=len(decode), length=1,
                snap_src=mx.array(src) if src else None, snap_dst=mx.array(dst) if dst else None,
            ))
            ids.append(cu[decode])
        if windows:
            groups.append(self._window_group(scheduled, windows, lens, cu, ids))
        for b in np.flatnonzero(lens > 1):
            if b in windows:
                continue
            req, n = scheduled[b]
            start = req.num_computed_tokens
            slot = mx.array([self.live[req.request_id]])
            cuts = self._boundaries(req, start, start + n)
            edges = sorted({start, start + n, *cuts})
            for a, e in zip(edges[:-1], edges[1:]):
                snap = self._take(req, e) if e in cuts else None
                rows = np.arange(cu[b] + a - start, cu[b] + e - start)
                groups.append(StateGroup(
                    rows=mx.array(rows.astype(np.int32)), slots=slot, batch=1, length=e - a,
                    snap_src=mx.array([0]) if snap is not None else None,
                    snap_dst=mx.array([snap]) if snap is not None else None,
                ))
                ids.append(rows)
        ids = np.concatenate(ids)
        if len(ids) == cu[-1] and (ids == np.arange(len(ids))).all():
            return StatePlan(groups, None)
        real = np.flatnonzero(ids >= 0)
        inverse = np.empty(cu[-1], dtype=np.int32)
        inverse[ids[real]] = real
        return StatePlan(groups, mx.array(inverse))

    def _window_group(self, scheduled, windows, lens, cu, ids: list) -> StateGroup:
        """Every window of the step in one run of the layer: a window of ``n`` positions runs as ``n``
        copies, copy ``j`` cut after position ``j`` (the rows past it masked as padding), so its final
        state is the state after ``j``: the last copy's goes back to the live slot, the others' to the
        window slots, and the last copy's rows are the window's outputs."""
        width = int(max(lens[b] for b in windows))
        rows, slots, write, lengths, src, dst = [], [], [], [], [], []
        for b in windows:
            req, n = scheduled[b][0], int(lens[b])
            live = self.live[req.request_id]
            start = req.num_computed_tokens
            self.windows[req.request_id] = (start, n)
            window_rows = cu[b] + np.minimum(np.arange(width), n - 1)  # padding repeats the last row
            for j in range(n):
                copy = len(lengths)
                rows.append(window_rows)
                slots.append(live)
                write.append(live if j == n - 1 else self._window_slot(live, j))
                lengths.append(j + 1)
                for p in self._boundaries(req, start + j, start + j + 1):
                    if (slot := self._take(req, p)) is not None:
                        src.append(copy)
                        dst.append(slot)
                ids.append(np.where(np.arange(width) < n, window_rows, -1) if j == n - 1 else np.full(width, -1))
        return StateGroup(
            rows=mx.array(np.concatenate(rows).astype(np.int32)), slots=mx.array(slots), batch=len(lengths),
            length=width, snap_src=mx.array(src) if src else None, snap_dst=mx.array(dst) if dst else None,
            lengths=mx.array(lengths), write_slots=mx.array(write),
        )

    # -- after the step, and at the end of a request ----------------------------------------------

    def _register(self, req: Request) -> None:
        """Key the snapshots ``req`` took by their blocks' hashes (which must be computed by now)."""
        for boundary, slot in self.pending.pop(req.request_id, ()):
            if boundary // self.block_size > len(req.block_hashes):
                self.free_snapshots.append(slot)  # its step never completed (the request failed in it)
                continue
            key = req.block_hashes[boundary // self.block_size - 1]
            old = self.snapshots.pop(key, None)
            if old is not None:
                self.free_snapshots.append(old)
            self.snapshots[key] = slot

    def commit(self, req: Request) -> None:
        window = self.windows.pop(req.request_id, None)
        if window is not None:
            start, n = window
            kept = req.num_computed_tokens - start  # the window's token and its accepted drafts
            if 0 < kept < n:
                live = self.live[req.request_id]
                self.restores[live] = self._window_slot(live, kept - 1)
        if req.request_id in self.pending:
            extend_hashes(req, req.num_computed_tokens // self.block_size, self.block_size)
            self._register(req)

    def free(self, req: Request) -> None:
        """Slots go back with the blocks; snapshots taken on the way stay, keyed by their blocks."""
        self.windows.pop(req.request_id, None)  # its state is dropped: nothing to restore
        self.commit(req)
        slot = self.live.pop(req.request_id, None)
        if slot is not None:
            self.restores.pop(slot, None)
            self.free_live.append(slot)
