"""A rank's part of the model: its run of layers (a pipeline) or its shard of every layer (tensor parallel).

Both come from mlx_lm's own methods: ``PipelineMixin.pipeline`` picks the
layers (the last rank the first ones, rank 0 the last), ``Model.shard`` splits
heads and MLP with ``shard_linear``. The pipeline's hand-offs are mlxd's, the
same for every family (``split``).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.pipeline import PipelineMixin

from mlxd.engined.model_layers import text_model, transformer_layers
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ModelLoadError

log = logging.getLogger("mlxd.engine")


def prepare(model, groups, config: EngineConfig) -> None:
    """Keep this rank's part of ``model``: its layers (a pipeline) or its shard of every layer
    (``groups``: ``pipeline.Groups``)."""
    if config.pipeline_parallel_size > 1:
        split(model, groups.link, config.pipeline_split)
    else:
        shard(model, groups.tensor)


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

    The split is the mixin's for every family; the hand-offs are mlxd's, around
    the body: a rank's embedding is replaced by what the next rank sends
    (``_Received``; the last rank embeds the tokens), and after its last layer a
    rank past 0 sends to the one before it (``hand_off``, once attention is
    installed), and its forward ends there. mlx_lm's pipelined bodies hand off
    themselves, ending with an all_gather so that every rank gets the output
    (its generate samples on every rank): that collective would hold every rank
    in every step until rank 0 is done, so no rank could start the next batch
    (``Engine`` keeps several in flight). Rank 0 alone samples, so those bodies
    are run as unsplit (``pipeline_size`` 1 over their own slice of layers).
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
            inner.pipeline(group, split=layers or None)  # the family's own (Qwen3-Next places its masks)
            inner.pipeline_rank, inner.pipeline_size = 0, 1  # its body then neither sends nor gathers
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
    """Add the send after a rank's last layer where ``split`` said the model needs it (ranks past 0)."""
    inner = text_model(model).model
    if getattr(inner, "mlxd_hands_off", False) and group.rank() != 0:
        inner.norm = _Handoff(inner.norm, group.rank())


def sent(model) -> mx.array:
    """What the last forward of a pipeline rank past 0 sends on: that rank evaluates this, not
    the forward's logits (the norm and head are rank 0's)."""
    return text_model(model).model.norm.sent


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
    """Around the final norm of a rank past 0: its output goes to the rank before it (``sent``)."""

    def __init__(self, norm: nn.Module, rank: int):
        super().__init__()
        self.norm = norm
        self.rank = rank
        self.sent: mx.array | None = None

    def __call__(self, h: mx.array) -> mx.array:
        self.sent = mx.distributed.send(h, self.rank - 1)
        return self.norm(h)  # built, never evaluated here: the logits are rank 0's
