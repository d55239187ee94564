"""Runs one packed step: builds the step's metadata once, runs the model, returns the sampled rows' logits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engined import attention
from engined.request import Request
from kernels import AttentionMetadata


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype):
        self.model = model
        self.block_size = block_size
        self.ctx = attention.StepContext()
        self.num_layers = len(attention.install(model, self.ctx))
        self.block_shape = (block_size, num_kv_heads, head_dim)
        self.dtype = dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * int(np.prod(self.block_shape)) * self.dtype.size

    def allocate_kv(self, num_blocks: int) -> None:
        """(Re)create the per-layer K/V pools with ``num_blocks`` blocks each, dropping the old ones."""
        self.ctx.k_caches, self.ctx.v_caches = [], []
        shape = (num_blocks, *self.block_shape)
        self.ctx.k_caches = [mx.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self.ctx.v_caches = [mx.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        mx.eval(self.ctx.k_caches, self.ctx.v_caches)

    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.ctx.k_caches) + sum(c.nbytes for c in self.ctx.v_caches)

    def execute(
        self, scheduled: list[tuple[Request, int]], block_tables: list[list[int]], num_logits: list[int],
    ) -> mx.array:
        """Forward the packed batch; returns logits ``[sum(num_logits), vocab]`` (not yet evaluated).

        ``scheduled[b] = (request, n)`` computes ``n`` tokens from the request's
        ``num_computed_tokens`` on: its known tokens, then its draft tokens
        (``spec_tokens``). The logits of its last ``num_logits[b]`` rows are
        returned, in order.
        """
        pieces = []
        for r, n in scheduled:
            known = r.token_ids[r.num_computed_tokens : r.num_computed_tokens + n]
            pieces.append(known if len(known) == n else known + r.spec_tokens[: n - len(known)])
        return self.forward(pieces, [r.num_computed_tokens for r, _ in scheduled], block_tables, num_logits)

    def forward(
        self, pieces: list[list[int]], offsets: list[int], block_tables: list[list[int]], num_logits: list[int],
    ) -> mx.array:
        """Forward token ``pieces[b]`` at positions ``offsets[b]...``; logits of each piece's last ``num_logits[b]`` rows."""
        query_lens = [len(p) for p in pieces]
        seq_lens = [o + n for o, n in zip(offsets, query_lens)]
        tokens = np.fromiter((t for piece in pieces for t in piece), dtype=np.int32, count=sum(query_lens))
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size)
        self.ctx.meta = meta
        ends = meta.cu_seqlens_q_np[1:]
        rows = [np.arange(end - k, end) for end, k in zip(ends, num_logits) if k]
        self.ctx.logit_rows = mx.array(np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32))
        logits = self.model(mx.array(tokens)[None])[0]
        self.ctx.meta = None
        return logits

    def caches(self) -> list[mx.array]:
        """The KV arrays written by the last forward; evaluate them with its outputs."""
        return self.ctx.k_caches + self.ctx.v_caches
