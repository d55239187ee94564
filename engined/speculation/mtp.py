"""MTP speculation: the checkpoint's own multi-token-prediction layer drafts ``k`` tokens per request.

Qwen3-Next and Qwen3.5 checkpoints carry one MTP layer (``mtp.*``), GLM-4.5
too (DeepSeek-V3's layout: the model's layer ``num_hidden_layers``); mlx_lm's
loaders drop it, ``engined.loaders`` sets it aside. For position ``t`` it
reads the embedding of token ``t+1`` and the target's final normed hidden
state at ``t``, each normed, concatenates them ([embedding | hidden]),
projects them back to the model's width (``fc``), runs one full-attention
decoder layer of the family's own mlx_lm class over its own K/V, norms, and
predicts token ``t+2`` through the target's LM head. Drafting position ``j``
feeds the layer its own output at ``j-1`` in place of the target's hidden
state, which does not exist yet.

The step (``MTPProposer.propose``, after scheduling, as the draft model):

1. the target's hidden states of the last forward (kept by ``HiddenTap``) are
   taken for the rows each request kept (its known tokens and accepted drafts);
2. one packed MTP forward over every request's new rows writes the layer's
   K/V at those positions (its next tokens are all known by now), and its last
   row, the request's last token, drafts the first token;
3. ``k - 1`` more one-row forwards draft the rest (``draft_loop``: greedy,
   sampled with the draft distribution kept for rejection sampling, or under
   a grammar), writing K/V past the computed length that the next step's
   first pass overwrites.

The layer's K/V live in the main pool (``kv/mtp_layer.py``), indexed by the
target's block ids; a prefix-cached block carries the MTP K/V its first
request wrote. Where none was written (a request that ended before its last
rows were taken), drafts are weaker, never wrong: the target verifies them.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.engined.kv.manager import KVCacheManager
from mlxd.engined.kv.mtp_layer import MTPLayerGroup
from mlxd.engined.loaders.mlx_dir import MTPWeights
from mlxd.engined.model_layers import LayerSpec, float_dtype, layer_settings, text_model
from mlxd.engined.request import Request
from mlxd.engined.runner import LastTokenNorm, PagedAttention
from mlxd.engined.sampler import Sampler
from mlxd.engined.kernels import AttentionMetadata
from mlxd.engined.speculation.draft_model import draft_loop, rows_for
from mlxd.engined.speculation.speculator import may_speculate
from mlxd.shared.errors import ModelLoadError

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "glm4_moe")

# GLM-4.5's names for the block's parts (DeepSeek-V3's layout), as this layer names them; its own
# copies of the embedding and head are the target's and are not loaded.
_GLM_NAMES = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
              "eh_proj.weight": "fc.weight", "shared_head.norm.weight": "norm.weight"}
_GLM_SHARED = ("embed_tokens.", "shared_head.head.")


class MTPLayer(nn.Module):
    """``norm(layer(fc([norm(embedding) | norm(hidden)])))``: the checkpoint's MTP block, under its names."""

    def __init__(self, layer: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, mask=None, cache=None) -> mx.array:
        """``embeddings, hidden [B, T, H]`` -> normed ``[B, T, H]``; ``cache``: the layer's step (paged) or None."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)],
                                   axis=-1))
        return self.norm(self.layers[0](x, mask, cache))


def _decoder_layer(model_type: str, args, moe: bool) -> tuple[nn.Module, int]:
    """A full-attention decoder layer of the family's own class, and the model layer index it poses as."""
    if model_type == "glm4_moe":
        from mlx_lm.models.glm4_moe import DecoderLayer

        return DecoderLayer(args, args.num_hidden_layers), args.num_hidden_layers  # past the dense first layers
    index = args.full_attention_interval - 1  # (index + 1) % interval == 0: attention, not a delta net
    if model_type == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

        # Whether it routes experts is the checkpoint's, not the layer index's.
        args = dataclasses.replace(args, mlp_only_layers=[] if moe else [index], decoder_sparse_step=1)
        return Qwen3NextDecoderLayer(args, index), index
    from mlx_lm.models.qwen3_5 import DecoderLayer

    return DecoderLayer(dataclasses.replace(args, num_experts=args.num_experts if moe else 0), index), index


def _glm_names(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """GLM-4.5's MTP layer tensors under Qwen's names: the block's parts renamed, its decoder layer's
    under ``layers.0.``, the copies of the embedding and head dropped."""
    return {_GLM_NAMES.get(name, f"layers.0.{name}"): w for name, w in tensors.items()
            if not name.startswith(_GLM_SHARED)}


def _as_layer_weights(tensors: dict[str, mx.array], shifted_norms: bool) -> dict[str, mx.array]:
    """The checkpoint's MTP tensors under the layer's parameter names: experts stacked (Qwen3-Next's
    and GLM's one tensor per expert, Qwen3.5's fused gate/up), norms shifted as the family shifted the model's."""
    out, experts = {}, {}
    for name, w in tensors.items():
        stem, sep, rest = name.partition(".experts.")
        if not sep:
            out[name] = w + 1.0 if shifted_norms and name.endswith("norm.weight") and w.ndim == 1 else w
            continue
        expert, _, proj = rest.partition(".")
        if expert.isdigit():  # Qwen3-Next: mlp.experts.{e}.{proj}.weight, one tensor per expert
            experts.setdefault(f"{stem}.switch_mlp.{proj}", {})[int(expert)] = w
        elif rest == "gate_up_proj":  # Qwen3.5 MoE: [E, 2 I, H], gate rows first
            gate, up = mx.split(w, 2, axis=-2)
            out[f"{stem}.switch_mlp.gate_proj.weight"], out[f"{stem}.switch_mlp.up_proj.weight"] = gate, up
        else:  # Qwen3.5 MoE: mlp.experts.down_proj [E, H, I]
            out[f"{stem}.switch_mlp.{rest}.weight"] = w
    for name, by_expert in experts.items():
        out[name] = mx.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def build_layer(model: nn.Module, model_type: str, weights: MTPWeights) -> tuple[MTPLayer, int]:
    """The MTP layer of ``model``'s checkpoint, weights loaded (strict) in the model's float dtype,
    and the target layer index its decoder layer was built as (for reading its attention)."""
    if model_type not in FAMILIES:
        raise ModelLoadError(f"MTP speculation runs the MTP layers of {', '.join(FAMILIES)}; "
                             f"this model is {model_type!r}", param="speculative_config")
    args = text_model(model).args
    tensors = _glm_names(weights.tensors) if model_type == "glm4_moe" else weights.tensors
    layer_names = {n.split(".", 2)[2] for n in tensors if n.startswith("layers.")}
    if {n.split(".", 2)[1] for n in tensors if n.startswith("layers.")} != {"0"}:
        raise ModelLoadError("MTP speculation runs a checkpoint with one MTP layer (mtp.layers.0)",
                             param="speculative_config")
    moe = any(n.startswith("mlp.experts.") or n.startswith("mlp.switch_mlp.") for n in layer_names)
    decoder, index = _decoder_layer(model_type, args, moe)
    layer = MTPLayer(decoder, args.hidden_size, args.rms_norm_eps)
    try:
        layer.load_weights(list(_as_layer_weights(tensors, weights.shifted_norms).items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"the checkpoint's MTP layer does not match its family's decoder layer: {e}",
                             param="speculative_config") from e
    layer.set_dtype(float_dtype(model))
    mx.eval(layer.parameters())
    return layer, index


class HiddenTap(nn.Module):
    """In place of the target's final norm: keeps the forward's hidden states (before the norm) for
    the MTP layer, and hands them on to the row-selecting norm (``LastTokenNorm``) unchanged."""

    def __init__(self, head: LastTokenNorm):
        super().__init__()
        self.head = head
        self.hidden: mx.array | None = None  # [1, T, H] of the last forward

    def __call__(self, h: mx.array) -> mx.array:
        self.hidden = h
        return self.head(h)


class TargetHiddenStates:
    """What a drafter that reads the target's hidden states keeps between steps (the MTP layer here,
    Gemma 4's assistant in ``engined.speculation.gemma4_assistant``): the tap in place of the target's final
    norm, the rows the last forward computed per request, and ``pending`` per request."""

    def __init__(self, model: nn.Module, head: LastTokenNorm):
        self.head = head
        self.tap = HiddenTap(head)
        text_model(model).model.norm = self.tap
        # Per request: (first position, target hidden states [n, H] (normed) from there on).
        self.pending: dict[str, tuple[int, mx.array]] = {}
        # The forward that ran last: (request, its first position, its rows, its first packed row).
        self._layout: list[tuple[Request, int, int, int]] = []

    def retain(self, request_ids) -> None:
        """Forget every request but these (finished or aborted ones, and preempted ones still waiting)."""
        keep = set(request_ids)
        self.pending = {rid: p for rid, p in self.pending.items() if rid in keep}

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)

    def _kept_rows(self, preempted: set[Request]) -> tuple[mx.array | None, list[tuple[Request, int, int, int]]]:
        """The last forward's hidden states (before the norm) and, per request still running, the rows
        it kept (its known tokens and accepted drafts): (request, first position, rows, first packed row)."""
        hidden, layout = self.tap.hidden, self._layout
        self.tap.hidden, self._layout = None, []
        if hidden is None:
            return None, []
        return hidden, [(req, start, min(n, req.num_computed_tokens - start), first)
                        for req, start, n, first in layout
                        if not req.finished and req not in preempted and req.num_computed_tokens > start]

    def _note(self, batch) -> None:
        """The rows this batch's forward computes for each request that may speculate."""
        self._layout, first = [], 0
        for req, n in batch.scheduled:
            if not req.pooled and may_speculate(req.params):
                self._layout.append((req, req.num_computed_tokens, n, first))
            first += n


class MTPProposer(TargetHiddenStates):
    """Drafts with the MTP layer; its K/V are an ``MTPLayerGroup`` of the target's KV manager.

    ``pending`` holds, per request, the hidden states of the positions whose MTP K/V are not
    written yet, or, once written, its last row (its last token's input, to draft from).
    """

    def __init__(self, model: nn.Module, head: LastTokenNorm, layer: MTPLayer, index: int, kv: KVCacheManager,
                 sampler: Sampler, block_size: int, dtype: mx.Dtype, backend: str = "auto"):
        super().__init__(model, head)
        decoder = layer.layers[0]
        settings = layer_settings(model, index, decoder, decoder.self_attn)
        decoder.self_attn = PagedAttention(decoder.self_attn, settings, backend)
        self.group = MTPLayerGroup(LayerSpec(0, settings=settings), block_size, dtype)
        kv.add(self.group)
        self.kv = kv
        self.layer = layer
        text = text_model(model)
        self.embed = text.model.embed_tokens
        self.lm_head = text.lm_head if "lm_head" in text else text.model.embed_tokens.as_linear
        self.sampler = sampler
        self.block_size = block_size
        self._kept = mx.zeros((0,))  # the last catch-up's kept rows, evaluated with its K/V

    def propose(self, batch, drafting: list[Request],
                drafts: list[list[int]]) -> tuple[mx.array | None, dict[Request, np.ndarray]]:
        """After scheduling ``batch``: take the last forward's hidden states, write the MTP K/V of
        every request's new positions, fill the drafts of ``drafting`` (sized; their rows in
        ``draft_loop``'s layout) and note the rows ``batch``'s forward will compute."""
        fresh = self._take_hidden(set(batch.preempted))
        ids = {r.request_id for r in drafting}
        catch_up = [r for r in fresh if r.request_id not in ids]
        for req in drafting:
            start, rows = self.pending.get(req.request_id, (0, None))
            if rows is None or start + len(rows) != req.num_computed_tokens:
                # No target state for its last token (cannot happen in order): drafts from nothing.
                self.pending[req.request_id] = (req.num_computed_tokens - 1,
                                                mx.zeros((1, self.head.inner.weight.shape[-1])))
        # The MTP outputs of the latest rows, [n, H], and the drafting requests (indices) they are of.
        carried: list = [[], None]

        def forward(j: int, active: list[int], previous: mx.array | None) -> mx.array:
            if j == 0:
                logits, carried[1] = self._catch_up(drafting + catch_up, len(drafting))
                carried[0] = list(range(len(drafting)))
                return logits
            pieces = [(drafting[i], drafting[i].num_computed_tokens + j - 1, 1) for i in active]
            logits, carried[1] = self._run(pieces, previous, rows_for(carried[1], carried[0], active),
                                           [True] * len(pieces))
            carried[0] = active
            return logits

        # The kept rows are evaluated with the K/V, so that nothing holds the last forward's hidden states.
        def written() -> list[mx.array]:
            return self.group.arrays() + [self._kept]

        probs, bits = None, {}
        if drafting:
            probs, bits = draft_loop(self.sampler, drafting, drafts, forward, written)
        elif catch_up:
            self._catch_up(catch_up, 0)
            mx.eval(written())
        self._note(batch)
        return probs, bits

    def _take_hidden(self, preempted: set[Request]) -> list[Request]:
        """The rows the last forward kept of each request (its known tokens and accepted drafts),
        pending now; returns those requests."""
        hidden, kept = self._kept_rows(preempted)
        if not kept:
            return []
        index = np.concatenate([np.arange(first, first + k) for _, _, k, first in kept]).astype(np.int32)
        normed = self.head.inner(hidden[0, mx.array(index)])
        at = 0
        for req, start, k, _ in kept:
            self.pending[req.request_id] = (start, normed[at : at + k])
            at += k
        return [req for req, *_ in kept]

    def _catch_up(self, reqs: list[Request], num_drafting: int) -> tuple[mx.array, mx.array]:
        """One MTP forward over each request's pending rows (its K/V written); logits and outputs
        ``[num_drafting, H]`` of the last row of the first ``num_drafting``. Each keeps its last
        row, for drafting later."""
        pending = [self.pending[req.request_id] for req in reqs]
        tokens = np.concatenate([req.token_ids[start + 1 : start + 1 + len(rows)]
                                 for req, (start, rows) in zip(reqs, pending)])
        logits, outs = self._run([(req, start, len(rows)) for req, (start, rows) in zip(reqs, pending)],
                                 mx.array(tokens.astype(np.int32)), mx.concatenate([rows for _, rows in pending]),
                                 [i < num_drafting for i in range(len(reqs))])
        # A copy (not a view of the step's rows), so the last forward's hidden states can go.
        self._kept = last = mx.concatenate([rows[-1:] for _, rows in pending])
        for i, (req, (start, rows)) in enumerate(zip(reqs, pending)):
            self.pending[req.request_id] = (start + len(rows) - 1, last[i : i + 1])
        return logits, outs

    def _run(self, pieces: list[tuple[Request, int, int]], tokens: mx.array, hidden: mx.array,
             want: list[bool]) -> tuple[mx.array, mx.array]:
        """Forward ``(request, first position, rows)`` pieces packed: their next tokens ``tokens
        [sum(rows)]`` (int32; drafts of the previous position perhaps not yet evaluated) and the
        hidden states ``[sum(rows), H]`` they follow. Logits ``[sum(want), V]`` and normed outputs
        ``[sum(want), H]`` of the last row of each piece that wants them."""
        lens = [n for *_, n in pieces]
        tables = [self.kv.block_ids(r.request_id) for r, *_ in pieces]
        meta = AttentionMetadata.build(lens, [s + n for _, s, n in pieces], tables, self.block_size)
        caches = [None]
        self.group.kv.steps(meta, caches)
        embeddings = self.embed(tokens[None])
        out = self.layer(embeddings, hidden.astype(embeddings.dtype)[None], None, caches[0])[0]
        ends = np.cumsum(lens) - 1
        rows = [int(e) for e, w in zip(ends, want) if w]
        if not rows:
            return mx.zeros((0,)), mx.zeros((0,))
        last = out[mx.array(rows)]
        return self.lm_head(last[None])[0], last
