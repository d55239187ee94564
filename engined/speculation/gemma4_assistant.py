"""Gemma 4's MTP assistant (``gemma4_assistant``): a small drafter that reads the target's own K/V.

The assistant is a few Gemma 4 decoder layers whose attention has queries
only: every layer attends over the K/V the target already wrote, the full-
attention layers over the target's last full-attention layer's, the sliding
ones over its last sliding layer's (the layers Gemma 4's own KV-shared layers
read), straight from the paged pool. It writes no K/V and adds nothing to the
pool; the memory guard counts its weights with the target's.

Drafting for a request whose last token ``x[p]`` has no K/V yet (the target's
query at ``p`` comes in the verifying forward):

- step 0 reads ``[embed(x[p]) * sqrt(H) | h[p-1]]``, the target's scaled
  embedding of that token and its final normed hidden state of the row that
  sampled it, projects it to the assistant's width (``pre_projection``), runs
  the layers with queries at position ``p`` over keys ``< p`` (a sliding layer:
  the window the target's query at ``p`` sees, less ``p`` itself), norms, and
  predicts the next token with its head: a plain LM head, or the
  centroid-masked one (``use_ordered_embeddings``: the top
  ``centroid_intermediate_top_k`` of ``num_centroids`` clusters, each a slice
  of ``token_ordering``, are scored, every other token gets their minimum
  less one);
- step ``j`` reads ``[embed(draft[j-1]) | post_projection(out[j-1])]`` at the
  same position ``p`` over the same keys: every step of a round stays at the
  request's last token's position, as transformers'
  ``SinglePositionMultiTokenCandidateGenerator`` drives it.

The target's hidden states of each forward are kept by ``mtp.TargetHiddenStates``
(the tap the MTP layer uses); only each request's last kept row is needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.gemma4_text import DecoderLayer, ModelArgs
from mlx_lm.utils import infer_quant_config

from mlxd.engined import kernels
from mlxd.engined.kv.manager import KVCacheManager
from mlxd.engined.loaders.mlx_dir import dense_weights, gemma4_text_fields, resolve_hf_repo
from mlxd.engined.model_layers import float_dtype, text_model
from mlxd.engined.request import Request
from mlxd.engined.runner import LastTokenNorm
from mlxd.engined.sampler import Sampler
from mlxd.engined.kernels import AttentionMetadata
from mlxd.engined.speculation.draft_model import draft_loop, rows_for
from mlxd.engined.speculation.mtp import TargetHiddenStates
from mlxd.shared.errors import ModelLoadError

MODEL_TYPE = "gemma4_assistant"
TARGETS = ("gemma4", "gemma4_text")
LAYER_TYPES = ("full_attention", "sliding_attention")


def _refuse(message: str) -> ModelLoadError:
    return ModelLoadError(message, param="speculative_config")


def assistant_dir(model: str) -> Path | None:
    """The directory of ``model`` (a path or a cached repo id) if it is a Gemma 4 assistant checkpoint."""
    path = Path(model).expanduser()
    if path.is_file():
        return None
    try:
        directory = path if path.exists() else resolve_hf_repo(model)
        config = json.loads((directory / "config.json").read_text())
    except (ModelLoadError, OSError, ValueError):
        return None  # the draft-model loader reports what is wrong with it
    return directory if config.get("model_type") == MODEL_TYPE else None


@dataclass
class SharedRead:
    """What one assistant layer attends over in a forward: a target layer's K/V pools, the
    metadata placing each query after its request's keys, the queries' RoPE positions."""

    meta: AttentionMetadata
    k: mx.array
    v: mx.array
    positions: mx.array  # [T]: each request's ``p`` (the metadata's own positions are ``p - 1``)
    window: int | None


class SharedKVAttention(nn.Module):
    """mlx_lm's Gemma 4 attention of a KV-shared layer (q_proj, q_norm, RoPE, o_proj, under the
    same names) over a target layer's paged K/V (``SharedRead``, passed as the layer's cache)."""

    def __init__(self, inner: nn.Module, backend: str):
        super().__init__()
        self.q_proj, self.q_norm, self.o_proj, self.rope = inner.q_proj, inner.q_norm, inner.o_proj, inner.rope
        self.n_heads, self.head_dim, self.scale = inner.n_heads, inner.head_dim, inner.scale
        self.attend = kernels.implementation(backend)

    def __call__(self, x: mx.array, mask=None, cache: SharedRead | None = None, shared_kv=None, offset=None):
        _, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(t, self.n_heads, self.head_dim))
        q = self.rope(q[:, :, None, :], offset=cache.positions)[:, :, 0, :]
        out = self.attend(q, cache.k, cache.v, cache.meta, self.scale, cache.window, None, None)
        return self.o_proj(out.reshape(1, t, -1)), None, None


class MaskedEmbedding(nn.Module):
    """The centroid-masked head's parts, under the checkpoint's names."""

    def __init__(self, hidden: int, vocab: int, num_centroids: int, top_k: int):
        super().__init__()
        self.centroids = nn.Linear(hidden, num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self.top_k = top_k

    def __call__(self, h: mx.array, lm_head: nn.Module) -> mx.array:
        """``h [T, H]``, the ``[V, H]`` head -> logits ``[T, V]``: the selected clusters' tokens scored,
        every other token at their minimum less one (per row)."""
        # A quantized weight packs its last axis only: the first is still the output's width.
        t, vocab = h.shape[0], lm_head.weight.shape[0]
        num_centroids = self.centroids.weight.shape[0]
        scores = self.centroids(h)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        ids = self.token_ordering.reshape(num_centroids, vocab // num_centroids)[top].reshape(t, -1)
        selected = (_head_rows(lm_head, ids) @ h[:, :, None])[..., 0]
        floor = selected.min(axis=-1, keepdims=True) - 1.0
        return mx.put_along_axis(mx.broadcast_to(floor, (t, vocab)), ids, selected, axis=-1)


def _head_rows(head: nn.Module, ids: mx.array) -> mx.array:
    """Rows ``ids`` of the head's ``[V, H]`` weight in floats: only those rows are dequantized."""
    if not isinstance(head, nn.QuantizedLinear):
        return head.weight[ids]
    biases = head.get("biases")
    return mx.dequantize(head.weight[ids], head.scales[ids], None if biases is None else biases[ids],
                         head.group_size, head.bits, head.mode)


def _text_args(text: dict) -> ModelArgs:
    """mlx_lm's args for the assistant's text config. Every layer is KV-shared: mlx_lm's classes then
    build queries only, and no double-wide MLP."""
    return ModelArgs.from_dict({**gemma4_text_fields(text), "num_kv_shared_layers": text["num_hidden_layers"]})


class Gemma4Assistant(nn.Module):
    """The checkpoint's modules, under its names less ``model.`` (``embed_tokens`` is the tied head)."""

    def __init__(self, config: dict):
        super().__init__()
        self.args = _text_args(config["text_config"])
        hidden, backbone = self.args.hidden_size, int(config["backbone_hidden_size"])
        self.layers = [DecoderLayer(self.args, i) for i in range(self.args.num_hidden_layers)]
        self.norm = nn.RMSNorm(hidden, eps=self.args.rms_norm_eps)
        self.pre_projection = nn.Linear(2 * backbone, hidden, bias=False)
        self.post_projection = nn.Linear(hidden, backbone, bias=False)
        self.lm_head = nn.Linear(hidden, self.args.vocab_size, bias=False)
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = MaskedEmbedding(hidden, self.args.vocab_size, int(config["num_centroids"]),
                                                    int(config["centroid_intermediate_top_k"]))

    def __call__(self, x: mx.array, reads: dict[str, SharedRead]) -> tuple[mx.array, mx.array]:
        """``x [T, 2 backbone]`` (one row per request) -> (logits ``[T, V]``, next input hidden ``[T, backbone]``)."""
        h = self.pre_projection(x)[None]
        for layer in self.layers:
            h, _, _ = layer(h, None, reads[layer.layer_type])
        h = self.norm(h)[0]
        if "masked_embedding" in self:
            logits = self.masked_embedding(h, self.lm_head)
        else:
            logits = self.lm_head(h)
        return logits, self.post_projection(h)


def _checkpoint_weights(directory: Path) -> dict[str, mx.array]:
    """The checkpoint's tensors under the module's names: ``model.`` cut, the tied embedding as the head."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise _refuse(f"{directory}: the Gemma 4 assistant checkpoint has no .safetensors files")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    out = {k.removeprefix("model."): v for k, v in weights.items()}
    tied = {k.removeprefix("embed_tokens."): out.pop(k) for k in list(out) if k.startswith("embed_tokens.")}
    if "lm_head.weight" not in out:  # with its scales and biases where the checkpoint is quantized
        out.update({f"lm_head.{part}": v for part, v in tied.items()})
    if "masked_embedding.token_ordering" in out:
        out["masked_embedding.token_ordering"] = out["masked_embedding.token_ordering"].astype(mx.int32)
    return out


def load_assistant(directory: Path, target: nn.Module, target_type: str) -> Gemma4Assistant:
    """The assistant of ``directory`` checked against ``target`` (a Gemma 4 model), weights loaded
    (strict) in the target's float dtype; a quantized checkpoint (an mlx-community conversion) stays
    quantized beside a quantized target and is dequantized beside a dense one."""
    if target_type not in TARGETS:
        raise _refuse(f"a Gemma 4 assistant drafts for a Gemma 4 target ({', '.join(TARGETS)}); "
                      f"this model is {target_type!r}")
    config = json.loads((directory / "config.json").read_text())
    args = text_model(target).args
    if "text_config" not in config or "backbone_hidden_size" not in config:
        raise _refuse(f"{directory}: a gemma4_assistant config.json needs text_config and backbone_hidden_size")
    if int(config["backbone_hidden_size"]) != args.hidden_size:
        raise _refuse(f"{directory}: the assistant's backbone_hidden_size is {config['backbone_hidden_size']}; "
                      f"the target's hidden size is {args.hidden_size}: it was trained for another model")
    vocab = config["text_config"].get("vocab_size")
    if vocab != args.vocab_size:
        raise _refuse(f"{directory}: the assistant's vocabulary has {vocab} tokens; the target's has "
                      f"{args.vocab_size}")
    assistant = Gemma4Assistant(config)
    weights = _checkpoint_weights(directory)
    try:
        _quantize_as_stored(assistant, config, weights)
        assistant.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise _refuse(f"{directory}: the weights do not match a gemma4_assistant of this config: {e}") from e
    if _is_quantized(target):
        assistant.set_dtype(float_dtype(target))
    else:  # a target run dense (every target on the CPU) runs its drafter dense too
        dense_weights(assistant, float_dtype(target))
    mx.eval(assistant.parameters())
    return assistant


def _is_quantized(model: nn.Module) -> bool:
    return any(name.endswith(".scales") for name, _ in tree_flatten(model.parameters()))


def _quantize_as_stored(assistant: Gemma4Assistant, config: dict, weights: dict[str, mx.array]) -> None:
    """Quantize the modules a quantized checkpoint (mlx_lm's or mlx-vlm's ``quantization`` entry)
    stores with scales: by its per-module settings (under the checkpoint's names, ``model.`` and
    all), else as the stored arrays' shapes say (mlx_lm's ``infer_quant_config``)."""
    q = config.get("quantization") or config.get("quantization_config")
    if not q:
        return

    def stored(path: str, module: nn.Module):
        for name in (path, f"model.{path}"):
            if name in q:  # a per-module entry: its own settings, or False for a module left dense
                return q[name]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(assistant, group_size=q.get("group_size", 64), bits=q.get("bits", 4), mode=q.get("mode", "affine"),
                class_predicate=stored)


@dataclass(frozen=True)
class _Source:
    """The target layer an assistant layer type reads: its KV group and its place in the group's arrays."""

    group: object  # engined.kv.group.KVGroup with ``kv`` (PagedArrays) and ``block_ids``
    index: int
    n_kv_heads: int
    head_dim: int
    window: int | None


def _sources(target: nn.Module, assistant: Gemma4Assistant, kv: KVCacheManager) -> dict[str, _Source]:
    """Per layer type, the target's last layer of that type that computes its own K/V (the one
    Gemma 4's KV-shared layers read), checked against the assistant's layers of the type."""
    args = text_model(target).args
    own = args.num_hidden_layers - args.num_kv_shared_layers
    sources = {}
    for kind in {layer.layer_type for layer in assistant.layers}:
        layer = max((i for i in range(own) if args.layer_types[i] == kind), default=None)
        group = next((g for g in kv.groups
                      if layer in g.layers and layer in getattr(getattr(g, "kv", None), "layers", ())), None)
        if layer is None or group is None:
            raise _refuse(f"the assistant has {kind} layers; the target has no such layer with K/V of its own")
        i = group.kv.layers.index(layer)
        _, n_kv, head_dim = group.kv.shapes[i]
        window = None
        if kind == "sliding_attention":
            # The keys the target's query at p sees, less p itself (not written before the verifying forward).
            window = min(args.sliding_window, assistant.args.sliding_window) - 1
        sources[kind] = _Source(group, i, n_kv, head_dim, window)
    for layer in assistant.layers:
        src, attn = sources[layer.layer_type], layer.self_attn
        if attn.head_dim != src.head_dim or attn.n_heads % src.n_kv_heads:
            raise _refuse(f"the assistant's {layer.layer_type} layers have {attn.n_heads} heads of {attn.head_dim}; "
                          f"the target's K/V there are {src.n_kv_heads} heads of {src.head_dim}")
    return sources


class Gemma4AssistantProposer(TargetHiddenStates):
    """Drafts with a Gemma 4 assistant over the target's K/V; ``pending`` keeps, per request, the
    target's normed hidden state of its last kept row: ``(position, [1, H])``."""

    def __init__(self, model: nn.Module, head: LastTokenNorm, assistant: Gemma4Assistant, kv: KVCacheManager,
                 sampler: Sampler, block_size: int, backend: str = "auto"):
        super().__init__(model, head)
        self.sources = _sources(model, assistant, kv)
        for layer in assistant.layers:
            layer.self_attn = SharedKVAttention(layer.self_attn, backend)
        self.assistant = assistant
        body = text_model(model).model
        self.embed, self.embed_scale = body.embed_tokens, body.embed_scale
        self.hidden_size = text_model(model).args.hidden_size
        self.dtype = float_dtype(model)
        self.sampler = sampler
        self.block_size = block_size
        self._fresh = mx.zeros((0,))  # the rows taken this step, evaluated with the first draft

    def propose(self, batch, drafting: list[Request],
                drafts: list[list[int]]) -> tuple[mx.array | None, dict[Request, np.ndarray]]:
        """After scheduling ``batch``: take the last forward's rows, fill the drafts of ``drafting``
        (sized; their rows in ``draft_loop``'s layout), and note the rows ``batch``'s forward computes."""
        self._take_hidden(set(batch.preempted))
        probs, bits = None, {}
        if drafting:
            # The next step's input hidden states [n, H] and the drafting requests (indices) they are of.
            carried = [list(range(len(drafting))), mx.concatenate([self._last_hidden(r) for r in drafting])]
            reads: dict[tuple[int, ...], dict[str, SharedRead]] = {}

            def forward(j: int, active: list[int], previous: mx.array | None) -> mx.array:
                reqs = [drafting[i] for i in active]
                tokens = mx.array([r.token_ids[-1] for r in reqs], dtype=mx.int32) if j == 0 else previous
                key = tuple(active)
                if key not in reads:
                    reads[key] = self.reads(reqs)
                logits, carried[1] = self.step(tokens, rows_for(carried[1], carried[0], active), reads[key])
                carried[0] = active
                return logits

            probs, bits = draft_loop(self.sampler, drafting, drafts, forward, lambda: [self._fresh])
        else:
            mx.eval(self._fresh)
        self._note(batch)
        return probs, bits

    def step(self, tokens: mx.array, hidden: mx.array, reads: dict[str, SharedRead]) -> tuple[mx.array, mx.array]:
        """One assistant forward: ``tokens [T]`` (int32; drafts perhaps not yet evaluated) and
        ``hidden [T, H]`` (the target's, or the assistant's previous ``post_projection``) ->
        (logits ``[T, V]``, next hidden ``[T, H]``)."""
        embedded = self.embed(tokens) * self.embed_scale
        return self.assistant(mx.concatenate([embedded, hidden.astype(embedded.dtype)], axis=-1), reads)

    def reads(self, reqs: list[Request]) -> dict[str, SharedRead]:
        """Per layer type, the K/V each request's draft queries attend over: every position before
        its last token's (``num_computed_tokens``)."""
        positions = [r.num_computed_tokens for r in reqs]
        rope = mx.array(np.array(positions, dtype=np.int32))
        metas, out = {}, {}
        for kind, src in self.sources.items():
            if id(src.group) not in metas:
                tables = [src.group.block_ids(r.request_id) for r in reqs]
                metas[id(src.group)] = AttentionMetadata.build([1] * len(reqs), positions, tables, self.block_size)
            arrays = src.group.kv
            out[kind] = SharedRead(metas[id(src.group)], arrays.k[src.index], arrays.v[src.index], rope, src.window)
        return out

    def _take_hidden(self, preempted: set[Request]) -> None:
        """Each request's last row the last forward kept, normed, pending now."""
        hidden, kept = self._kept_rows(preempted)
        if not kept:
            return
        index = mx.array(np.array([first + k - 1 for _, _, k, first in kept], dtype=np.int32))
        self._fresh = rows = self.head.inner(hidden[0, index])
        for i, (req, start, k, _) in enumerate(kept):
            self.pending[req.request_id] = (start + k - 1, rows[i : i + 1])

    def _last_hidden(self, req: Request) -> mx.array:
        """The target's hidden state of the row before the request's last token; zeros (weak drafts,
        never wrong ones: the target verifies) where none was kept."""
        position, row = self.pending.get(req.request_id, (None, None))
        if position != req.num_computed_tokens - 1:
            return mx.zeros((1, self.hidden_size), dtype=self.dtype)
        return row
