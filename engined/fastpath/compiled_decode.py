"""Decode steps replayed from a compiled graph instead of built again in Python, layer by layer.

A step of decode rows (one new token per request) builds the same graph as the
step before it whenever its arrays have the same shapes: only the tokens,
positions, slots, lengths, tables and pools differ, and those are arrays. So
the forward is traced once per shape with ``mx.compile``, every per-step array
an input and every K/V pool an input and an output, and later steps replay the
trace. On a GPU the step's host time is what bounds a decode step at high
concurrency (``bench/gpu_serving_results.md``); the replay skips the model's
Python, which builds the graph node by node.

What the attention implementation derives from the host's copies of the
metadata is part of the key (``kernels.replay_key``): a graph is only replayed
for a step that would have built the same one. Block tables are padded to
``paged_kv.TABLE_WIDTH_STEP`` blocks, so growing contexts keep a step's shapes
for many steps. A key is traced the second time it is met, not the first. Each
is one compiled function holding one trace; the least recently used are
dropped past ``MAX_GRAPHS``, which frees MLX's trace.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import mlx.core as mx

from mlxd.engined import kernels
from mlxd.engined.kernels import AttentionMetadata
from mlxd.engined.kv.manager import PagedArrays, PagedLayerStep

log = logging.getLogger("mlxd.engine")

MAX_GRAPHS = 32  # traces kept: a step's batch size and table widths pick one


class CompiledDecode:
    """Runs a decode step's forward through the compiled trace for its shapes (traced on first use)."""

    def __init__(self, run: Callable[[mx.array, list], mx.array], head, backend: str):
        self.run = run  # runner.run_model for the model: its output over packed tokens and layer steps
        self.head = head  # runner.LastTokenNorm: the rows it keeps become an input of the trace
        self.backend = backend
        self._graphs: OrderedDict[tuple, Callable] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # keys met once and built, not traced yet
        # The step being traced: its host metadata and layer steps, read only while tracing.
        self._tracing: tuple | None = None
        self.traces = 0  # graphs traced
        self.calls = 0  # steps run through a graph (each trace's first among them)
        self.off = False  # set for good when a trace fails

    @staticmethod
    def takes(caches: list) -> bool:
        """Whether every layer's step is a paged one (hybrid models' recurrent slots are not traced)."""
        return all(isinstance(c, PagedLayerStep) for c in caches)

    def __call__(self, tokens: mx.array, rows: mx.array, caches: list) -> mx.array | None:
        """Logits of ``rows`` for the step whose packed ``tokens`` and layer steps ``caches`` are given
        (not yet evaluated), the pools replaced by their written versions; None where the step cannot
        replay (``kernels.replay_key``) or its shapes are met for the first time: nothing is done then,
        and the caller builds the step."""
        if self.off or not self.takes(caches):
            return None
        metas: dict[int, AttentionMetadata] = {}
        holders: dict[int, PagedArrays] = {}
        for c in caches:
            metas.setdefault(id(c.meta), c.meta)
            holders.setdefault(id(c.arrays), c.arrays)
        plans = []
        for meta in metas.values():
            plan = kernels.replay_key(self.backend, meta)
            if plan is None:
                return None
            plans.append(plan)
        shapes = (tokens.shape, rows.shape, *(m.block_tables.shape for m in metas.values()),
                  *(a.k[0].shape for a in holders.values() if a.k))
        key = (tuple(plans), shapes)
        graph = self._graphs.get(key)
        fresh = graph is None
        if fresh:
            # Tracing costs ~3.5 builds of the graph (CPU, 36 layers): a shape met once, as a batch that
            # changes every step makes, is built; the second time it is traced.
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > MAX_GRAPHS:
                    self._seen.popitem(last=False)
                return None
            del self._seen[key]
            graph = self._graphs[key] = mx.compile(self._forward)
            self.traces += 1
            if len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        inputs = [tokens, rows]
        for m in metas.values():
            inputs += [m.cu_seqlens_q, m.seq_lens, m.block_tables, m.slot_mapping, m.positions]
        for a in holders.values():
            inputs += a.arrays()
        self._tracing = (list(metas.values()), list(holders.values()), caches)
        try:
            out = graph(*inputs)
        except Exception:
            if not fresh:
                raise
            # Tracing runs the model's own code under mx.compile: an operation a device's compile cannot
            # take fails here, before anything is written, and the engine goes on building its steps.
            log.warning("decode steps are built from now on: tracing one failed", exc_info=True)
            self.off = True
            self._graphs.clear()
            return None
        finally:
            self._tracing = None
        self.calls += 1
        at = 1
        for a in holders.values():
            n = len(a.k)
            a.k[:], a.v[:] = out[at : at + n], out[at + n : at + 2 * n]
            at += 2 * n
        return out[0]

    def _forward(self, tokens: mx.array, rows: mx.array, *arrays: mx.array) -> list[mx.array]:
        """The traced step: the model over ``caches``' layers rebuilt on the traced arrays; returns the
        logits, then every pool as written."""
        metas, holders, caches = self._tracing
        at, traced_metas, traced_holders = 0, {}, {}
        for m in metas:
            cu, seq_lens, tables, slots, positions = arrays[at : at + 5]
            at += 5
            traced_metas[id(m)] = AttentionMetadata(cu, seq_lens, tables, slots, positions, m.query_lens_np,
                                                    m.seq_lens_np, m.cu_seqlens_q_np, m.block_size)
        for a in holders:
            n = 2 * len(a.k)
            traced_holders[id(a)] = a.holding(arrays[at : at + n])
            at += n
        steps: dict[int, PagedLayerStep] = {}
        for c in caches:  # layers sharing a step object (K/V shared with an earlier layer) keep sharing it
            if id(c) not in steps:
                steps[id(c)] = c.rebound(traced_metas[id(c.meta)], traced_holders[id(c.arrays)])
        self.head.rows = rows
        try:
            logits = self.run(tokens, [steps[id(c)] for c in caches])
        finally:
            self.head.rows = None
        return [logits] + [p for h in traced_holders.values() for p in h.arrays()]
