"""A rank's part of the model: its run of layers (a pipeline) or its shard of every layer (tensor parallel).

Both come from mlx_lm's own methods: ``PipelineMixin.pipeline`` picks the
layers (the last rank the first ones, rank 0 the last), ``Model.shard`` splits
heads and MLP with ``shard_linear``. For families whose mlx_lm body has no
pipeline hand-offs, ``split`` adds them around the body.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.pipeline import PipelineMixin

from engined.model_layers import text_model, transformer_layers
from shared.config import EngineConfig
from shared.errors import ModelLoadError

log = logging.getLogger("mlxd.engine")


def prepare(model, group: mx.distributed.Group, config: EngineConfig) -> None:
    """Keep this rank's part of ``model``: its layers (a pipeline) or its shard of every layer."""
    if config.pipeline_parallel_size > 1:
        split(model, group, config.pipeline_split)
    else:
        shard(model, group)


def shard(model, group: mx.distributed.Group) -> None:
    """mlx_lm's own ``shard``: each rank computes its share of every layer's heads and MLP, summed
    across ranks; refused where the family has none or the heads do not divide evenly."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if not hasattr(model, "shard"):
        raise ModelLoadError(f"{family}: mlx_lm's model cannot shard; tensor parallelism needs a family that "
                             "can (llama, qwen2, qwen3, qwen3_moe, qwen3_5, deepseek_v3, glm4_moe, gpt_oss, ...)")
    n = group.size()
    for i, layer in enumerate(transformer_layers(model)):
        attn = getattr(layer, "self_attn", None)
        heads = [getattr(attn, name, None) for name in ("n_heads", "n_kv_heads", "num_attention_heads",
                                                        "num_key_value_heads")]
        uneven = [h for h in heads if isinstance(h, int) and h % n]
        if uneven:
            raise ModelLoadError(f"{family} layer {i}: {uneven[0]} heads cannot be split over {n} tensor-parallel "
                                 "ranks; pick a --tensor-parallel-size that divides the KV heads")
    model.shard(group)
    log.info("tensor-parallel rank %d of %d", group.rank(), n)


def split(model, group: mx.distributed.Group, layers: list[int] | None) -> None:
    """Keep only this rank's layers of ``model``, split by mlx_lm's PipelineMixin.

    Families whose mlx_lm model has the mixin pass hidden states on themselves.
    For the others (llama, qwen3, ...) the split is the mixin's too, and the
    hand-offs the mixin's models make in their bodies are added around the
    body: the embedding of a rank past 0 is replaced by what the next rank sends
    (``_Received``), and after its last layer a rank sends to the one before it
    and every rank gathers rank 0's output (``hand_off``, once attention is installed).
    """
    inner = getattr(text_model(model), "model", None)
    family = type(model).__module__.rsplit(".", 1)[-1]
    if inner is None or not isinstance(getattr(inner, "layers", None), list):
        raise ModelLoadError(f"{family}: no layer list to split over pipeline ranks")
    if any(j != i for i, j in enumerate(getattr(inner, "previous_kvs", None) or ())):
        raise ModelLoadError(f"{family}: layers that read earlier layers' K/V (Gemma 4) cannot be split over "
                             "pipeline ranks yet")
    try:
        if hasattr(inner, "pipeline"):
            inner.pipeline(group, split=layers or None)
        else:
            PipelineMixin.pipeline(inner, group, split=layers or None)
            inner.layers = inner.layers[inner.start_idx:]
            if group.rank() < group.size() - 1:
                inner.embed_tokens = _Received(inner.embed_tokens, group.rank() + 1)
            inner.mlxd_hands_off = True
    except ValueError as e:
        raise ModelLoadError(f"--pipeline-split: {e}" if layers else
                             f"{len(inner.layers)} layers cannot be split over {group.size()} pipeline ranks") from e
    log.info("pipeline rank %d of %d: layers %d..%d", group.rank(), group.size(), inner.start_idx,
             inner.end_idx - 1)


def hand_off(model, group: mx.distributed.Group) -> None:
    """Add the send and gather after a rank's last layer where ``split`` said the model needs them."""
    inner = text_model(model).model
    if getattr(inner, "mlxd_hands_off", False):
        inner.norm = _Handoff(inner.norm, group.rank())


class _Received(nn.Module):
    """A rank's input: the hidden states the next rank sends, in place of the token embedding."""

    def __init__(self, embedding: nn.Module, source: int):
        super().__init__()
        self.embedding = embedding
        self.source = source

    def __call__(self, tokens: mx.array) -> mx.array:
        return mx.distributed.recv_like(self.embedding(tokens), self.source)

    def as_linear(self, x: mx.array) -> mx.array:  # a tied output head still reads the embedding
        return self.embedding.as_linear(x)


class _Handoff(nn.Module):
    """Around the final norm: send this rank's output down the pipeline, take rank 0's (the model's)."""

    def __init__(self, norm: nn.Module, rank: int):
        super().__init__()
        self.norm = norm
        self.rank = rank

    def __call__(self, h: mx.array) -> mx.array:
        if self.rank != 0:
            h = mx.distributed.send(h, self.rank - 1)
        return self.norm(mx.distributed.all_gather(h)[: h.shape[0]])
