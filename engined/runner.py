"""Runs one packed step: the tokens and each layer's step object in, the sampled rows' logits out.

The changes mlxd makes to an mlx_lm model are all made here, at install (``install``, ``hold_transposes``).
Its attention modules read the paged KV: each is swapped for a ``PagedAttention`` that keeps the original
projections, norms and RoPE, writes this step's K/V into the paged cache by ``slot_mapping`` and runs the
``engined.kernels.paged_attention`` implementation chosen at start-up over the packed batch. Everything
token-wise (embeddings, norms, MLP, MoE, head) runs unchanged on the packed ``[1, T, hidden]``
activations, its linears rewritten only so that a step's graph has fewer nodes (at the end): a step on a
GPU is bound by the host's cost per graph node (``bench/gpu_serving_results.md``), so

- linears of one input run as one (``fuse_linears``, ``join_siblings``): one
  matmul where several ran, as vLLM's ``QKVParallelLinear`` and
  ``MergedColumnParallelLinear`` do. The paged attention joins its own q/k/v;
  an MLP's gate/up, called by mlx_lm's code one by one, become
  ``JoinedMember`` views of one ``JoinedLinears``, as the LoRA groups do for
  both (``engined/lora/groups.py``);
- a dense linear holds its weight's transpose (``hold_transposes``):
  ``nn.Linear`` computes ``x @ weight.T`` (a tied LM head,
  ``nn.Embedding.as_linear``, the same), a Transpose node per call, four per
  decoder layer plus the LM head. The transpose is a view: made and evaluated
  once, it is an array with the weight's memory and swapped strides, which the
  matmul reads as it would read the node's output, so the result is the same
  bit for bit.

Per-step data arrives as mlx_lm's own ``cache`` argument: the runner passes
the model one step object per layer (``engined.kv``: this step's metadata and
that layer's arrays), which mlx_lm hands to each layer's attention. What
differs between families is read once from each layer (``model_layers``).
Hybrid models' linear-attention layers are wrapped to run on per-request
state slots (``linear_attention``).

Over 400 lines because what mlxd does to a model is read in one place with the step that runs it: the
modules swapped in at install (paged attention, joined and transposed linears, the final norm cut to the
sampled rows) are the forward the step calls.
"""

from __future__ import annotations

import copy
import functools
import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.engined import kernels
from mlxd.engined.fastpath.compiled_decode import CompiledDecode
from mlxd.engined.kernels import gated_delta
from mlxd.engined.kernels.qk_rope import QKRope
from mlxd.engined.kv.manager import KVCacheManager
from mlxd.engined.linear_attention import SlottedLinearAttention
from mlxd.engined.model_layers import LayerSettings, LayerSpec, flat_stream, text_model, transformer_layers
from mlxd.engined.scheduler import SchedulerOutput
from mlxd.engined.vision.embeds import ImageEmbeds
from mlxd.engined.vision.mrope import install_mrope
from mlxd.shared.errors import ModelLoadError


def _row_index(ends: np.ndarray, counts: list[int]) -> mx.array:
    """Indices of each piece's last ``counts[b]`` rows in the packed sequence."""
    k = np.asarray(counts, dtype=np.int64)
    if (k == 1).all():  # a row each: the pieces' last rows
        return mx.array(ends.astype(np.int32) - 1)
    # Row j of piece b's k[b] rows is ends[b] - k[b] + j; j counted across pieces without a loop.
    first = np.repeat(ends - k, k)
    j = np.arange(first.size) - np.repeat(np.cumsum(k) - k, k)
    return mx.array((first + j).astype(np.int32))


def forward(model: nn.Module, head: LastTokenNorm, pieces: list[list[int]], caches: list,
            num_logits: list[int]) -> mx.array:
    """Forward token ``pieces`` packed as one sequence; logits of each piece's last ``num_logits[b]`` rows.

    ``caches`` is the model's ``cache`` argument: one step object per layer.
    Returns ``[sum(num_logits), vocab]``, not yet evaluated.
    """
    return forward_pooled(model, head, pieces, caches, num_logits)[0]


def forward_pooled(model: nn.Module, head: LastTokenNorm, pieces: list[list[int]], caches: list,
                   num_logits: list[int], num_hidden: list[int] | None = None,
                   fills: tuple[list[int], mx.array] | None = None, flat: bool = False,
                   compiled: CompiledDecode | None = None,
                   images: tuple[mx.array, mx.array] | None = None) -> tuple[mx.array, mx.array | None]:
    """``forward``, and when ``num_hidden`` asks for any, the final normed hidden states
    ``[sum(num_hidden), hidden]`` of each piece's last ``num_hidden[b]`` rows (else None).

    ``fills`` = (packed positions, tokens [len]) puts device-side tokens (a
    step still in flight sampled them) at those positions. ``flat``: the model
    takes the tokens 1-D and runs on a 2-D stream (``model_layers.FLAT_STREAM``).
    ``compiled``: a step it can replay runs through it. ``images`` = (packed positions, rows
    [len, hidden]) replaces those positions' token embeddings (``engined.vision``).
    """
    lens = [len(p) for p in pieces]
    tokens = mx.array(np.fromiter((t for piece in pieces for t in piece), dtype=np.int32, count=sum(lens)))
    if fills is not None:
        at, values = fills
        tokens[mx.array(np.array(at, dtype=np.int32))] = values.astype(mx.int32)
    ends = np.cumsum(lens)
    rows = _row_index(ends, num_logits)
    wants_hidden = bool(num_hidden and any(num_hidden))
    if compiled is not None and not wants_hidden and images is None:
        logits = compiled(tokens, rows, caches)
        if logits is not None:
            return logits, None
    head.rows = rows
    if wants_hidden:
        head.hidden_rows = _row_index(ends, num_hidden)
    try:
        embeds = None
        if images is not None:  # the image tokens' rows are the vision tower's, the rest the text model's own
            embeds = text_model(model).model.embed_tokens(tokens)
            embeds[images[0]] = images[1].astype(embeds.dtype)
            # Image positions read as token 0 where a model looks a token up beside its row (Gemma 4's
            # per-layer inputs), as mlx-vlm feeds them.
            tokens = tokens.at[images[0]].multiply(0)
        logits, hidden_states = run_model(model, tokens, caches, flat, embeds), head.hidden
        if hidden_states is not None and not flat:  # the packed stream's batch of one
            hidden_states = hidden_states[0]
        return logits, hidden_states
    finally:
        head.rows = head.hidden_rows = head.hidden = None


def run_model(model: nn.Module, tokens: mx.array, caches: list, flat: bool, embeds: mx.array | None = None
              ) -> mx.array:
    """The model's output over the packed ``tokens``: 1-D on a flat stream, else as a batch of one.
    ``embeds [len, hidden]``: the input rows to use in place of the tokens' embeddings."""
    if embeds is not None:
        return (model(tokens, cache=caches, input_embeddings=embeds) if flat
                else model(tokens[None], cache=caches, input_embeddings=embeds[None])[0])
    return model(tokens, cache=caches) if flat else model(tokens[None], cache=caches)[0]


class ModelRunner:
    """The model with its attention swapped for paged attention, run over the KV manager's groups."""

    def __init__(self, model: nn.Module, specs: list[LayerSpec], kv: KVCacheManager, attention_backend: str = "auto",
                 lora=None, compile_decode: bool = False, images: ImageEmbeds | None = None):
        self.model = model
        self.kv = kv
        # A vision-language model's image rows (engined/vision/); None: text only.
        self.images = images
        # Qwen-VL's per-token multi-axis positions (engined/vision/mrope.py); None: one position per token.
        self.mrope = install_mrope(model, images.tower.config) if images is not None else None
        self.head = install(model, specs, attention_backend)
        # The adapters' slots (engined.lora.registry.LoraRegistry; their layers are already in the model); None: LoRA
        # is off.
        self.lora = lora
        if lora is None:  # LoRA's groups write adapters into their bases' weights in place
            hold_transposes(model)
        self.flat = flat_stream(model)
        # Decode steps replayed from a trace (engined/fastpath/compiled_decode.py); not with adapters, whose
        # slots change between steps what a layer computes.
        self.compiled = (CompiledDecode(functools.partial(run_model, model, flat=self.flat), self.head,
                                        attention_backend) if compile_decode and lora is None else None)

    def run(self, batch: SchedulerOutput, num_logits: list[int] | None = None) -> mx.array:
        """Forward the batch; logits ``[sum(num_logits), vocab]`` (not yet evaluated).

        ``batch.scheduled[b] = (request, n)`` computes ``n`` tokens from the
        request's ``num_computed_tokens`` on: its known tokens, then its drafts
        (``batch.drafts``). ``num_logits`` (default: the rows the batch samples,
        ``batch.num_logits``) says how many of each request's last rows to return.
        """
        return self.run_pooled(batch, num_logits)[0]

    def run_pooled(self, batch: SchedulerOutput, num_logits: list[int] | None = None, inflight=None
                   ) -> tuple[mx.array, mx.array | None]:
        """``run``, plus the final hidden states of the rows ``batch.hidden_rows`` asks for (embed
        requests' last tokens, in batch order; None when none does). A request's placeholder (its
        last token, sampled by the step in flight ``inflight``, an ``engined.sampler.LaunchedStep``)
        is read from the device."""
        num_logits = batch.num_logits if num_logits is None else num_logits
        pieces = self.pieces(batch)
        fills = self.fills(batch, inflight) if inflight is not None else None
        caches = self.kv.step_caches(batch.scheduled)
        if self.lora is not None:
            self.lora.set_step([r.lora_slot for r, _ in batch.scheduled], [n for _, n in batch.scheduled])
        # A step with M-RoPE positions runs uncompiled: the replayed decode rotates by one position per token.
        mrope = self.mrope is not None and self.mrope.set_step(batch.scheduled)
        try:
            images = self.images.step_rows(batch.scheduled) if self.images is not None else None
            return forward_pooled(self.model, self.head, pieces, caches, num_logits, batch.hidden_rows, fills,
                                  self.flat, None if mrope else self.compiled, images)
        finally:
            if mrope:
                self.mrope.clear()
            if self.lora is not None:
                self.lora.set_step([], [])

    @staticmethod
    def pieces(batch: SchedulerOutput) -> list[list[int]]:
        """Each scheduled request's tokens of this step: its known tokens, then its drafts, or a 0
        where its placeholder goes (``fills``)."""
        pieces = []
        for r, n in batch.scheduled:
            known = r.token_ids[r.num_computed_tokens : r.num_computed_tokens + n]
            if len(known) < n:
                known = known + (batch.drafts[r][: n - len(known)] if r in batch.drafts else [0])
            pieces.append(known)
        return pieces

    @staticmethod
    def fills(batch: SchedulerOutput, inflight) -> tuple[list[int], mx.array] | None:
        """(packed positions, tokens) of the step's placeholders: each the last token of its
        request's piece, read on the device from the step in flight that sampled it."""
        at, rows, offset = [], [], 0
        for r, n in batch.scheduled:
            offset += n
            if r.num_computed_tokens + n > r.num_tokens and r not in batch.drafts:
                at.append(offset - 1)
                rows.append(inflight.row_of(r))
        return (at, inflight.feed[mx.array(rows)]) if at else None


# The modules of an mlx_lm attention that the paged form keeps, under the same names (so parameter
# paths, quantization and adapters stay as mlx_lm has them); each is there only in some families.
_KEPT = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm", "v_norm", "rope")


class PagedAttention(nn.Module):
    def __init__(self, inner: nn.Module, settings: LayerSettings, backend: str = "auto", shares_kv: bool = False):
        super().__init__()
        for name in _KEPT:
            if name in inner:
                setattr(self, name, inner[name])
        if settings.has_sinks:
            self.sinks = inner.sinks  # same parameter path as the original module's
        self.settings = settings
        # Reads the K/V an earlier layer wrote in this forward (its step object is this layer's cache).
        self.shares_kv = shares_kv
        # The kernels.paged_attention implementation (EngineConfig.attention_backend), chosen once here.
        self.attend = kernels.implementation(backend)
        # What every call branches on, resolved once here into plain attributes: the call runs once
        # per layer per step, on the host's critical path (bench/host_step_results.md).
        s = settings
        self._q_norm_heads = "q_norm" in self and not s.qk_norm_whole
        self._k_norm_heads = "k_norm" in self and not s.qk_norm_whole
        self._v_norm = "v_norm" in self
        self._q_width = s.n_heads * s.head_dim
        self._qkv_width = self._q_width + s.n_kv_heads * s.head_dim
        self._fused_qkv = s.fused_qkv
        # Three projections of one input as one matmul, as vLLM's QKVParallelLinear: a decode step on
        # a GPU is bound by the host's cost per launched operation, and this saves two per layer.
        if not (s.fused_qkv or shares_kv or s.k_is_v) and all(n in self for n in ("q_proj", "k_proj", "v_proj")):
            fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
            if fused is not None:
                self._q_width = self.q_proj.weight.shape[0]
                self._qkv_width = self._q_width + self.k_proj.weight.shape[0]
                for name in ("q_proj", "k_proj", "v_proj"):
                    self.pop(name)
                self.qkv_proj = fused
                self._fused_qkv = True
        # The common form's queries, keys and values in one launch on CUDA, ten graph nodes fewer a layer.
        self._qk_rope = None
        q_norm, k_norm = self.get("q_norm"), self.get("k_norm")
        plain = not (s.output_gate or s.qk_norm_whole or self._v_norm or s.query_position_scale is not None
                     or shares_kv or s.k_is_v)
        if (plain and self._fused_qkv and kernels.resolve_backend(backend) == "cuda"
                and QKRope.takes(self.get("rope"), q_norm, k_norm, s.head_dim)):
            self._qk_rope = QKRope(s.n_heads, s.n_kv_heads, s.head_dim, self.rope, q_norm, k_norm)

    def _rope(self, x: mx.array, positions: mx.array) -> mx.array:
        """``x [T, H, 1, D]``: each token its own "batch" row, so that RoPE takes a per-token offset."""
        return self.rope(x, offset=positions).squeeze(2)

    def _kv(self, k: mx.array, v: mx.array | None, positions: mx.array) -> tuple[mx.array, mx.array]:
        """This step's ``k, v [T, H_kv, D]`` from the projections' outputs (``v`` None: V is K's)."""
        s, t = self.settings, k.shape[0]
        v = k if v is None else v
        if s.qk_norm_whole:
            k = self.k_norm(k)
        k, v = k.reshape(t, s.n_kv_heads, 1, -1), v.reshape(t, s.n_kv_heads, -1)
        if self._k_norm_heads:
            k = self.k_norm(k)
        if self._v_norm:
            v = self.v_norm(v)
        return self._rope(k, positions), v

    def __call__(self, x: mx.array, *args, mask=None, cache=None, shared_kv=None, offset=None):
        """``cache``: this layer's ``engined.kv.manager.PagedLayerStep`` (metadata, K/V arrays).

        mlx_lm's families call their attention as ``(x, mask, cache)``, with an extra leading
        input (Ministral 3's query scale) or trailing ones (Gemma 4's ``shared_kv`` and
        ``offset``): the cache is the keyword or the last positional argument. The mask and
        those inputs are not used: the kernel masks by the step's metadata, the query scale is
        recomputed from each token's position, and shared K/V are read from the pool.
        """
        if cache is None and args:
            cache = args[-1]
        meta = getattr(cache, "meta", None)
        if meta is None:
            raise RuntimeError("a paged attention layer ran without its step: run the model through "
                               "mlxd.engined.runner.ModelRunner")
        s = self.settings
        # The layer runs on [T, hidden], [T, heads, 1, D] around RoPE: a 3-D input costs a matmul a flatten
        # and an unflatten, and a step on a GPU is bound by the host's cost per operation. A flat stream's
        # input is 2-D already (model_layers.FLAT_STREAM), and so is its output.
        packed = x.ndim == 3
        t = x.shape[-2]
        if packed:
            x = x.reshape(t, -1)
        if self._qk_rope is not None:
            q, k, v = self._qk_rope(self.qkv_proj(x), meta.positions)
            return self._attention_out(q, *cache.write(k, v), meta, None, packed)
        if self._fused_qkv:
            q, k, v = mx.split(self.qkv_proj(x), [self._q_width, self._qkv_width], axis=-1)
        else:
            q = self.q_proj(x)
        if s.qk_norm_whole:
            q = self.q_norm(q)
        q = q.reshape(t, s.n_heads, 1, -1)
        gate = None
        if s.output_gate:
            q, gate = mx.split(q, 2, axis=-1)
        if self._q_norm_heads:
            q = self.q_norm(q)
        positions = meta.positions
        q = self._rope(q, positions)
        if s.query_position_scale is not None:
            beta, length = s.query_position_scale
            scale = 1 + beta * mx.log(1 + mx.floor(positions.astype(mx.float32) / length))
            q = q * scale.astype(q.dtype)[:, None, None]
        if self.shares_kv:
            kc, vc = cache.read()
        else:
            if not self._fused_qkv:
                k = self.k_proj(x)
                v = None if s.k_is_v else self.v_proj(x)
            kc, vc = cache.write(*self._kv(k, v, positions))
        return self._attention_out(q, kc, vc, meta, gate, packed)

    def _attention_out(self, q: mx.array, kc: mx.array, vc: mx.array, meta, gate: mx.array | None, packed: bool):
        """The attention of ``q [T, H, D]`` over the layer's pools, through the output projection
        (``[1, T, hidden]`` where the layer's input was ``packed`` so, else ``[T, hidden]``)."""
        s, t = self.settings, q.shape[0]
        out = self.attend(q, kc, vc, meta, s.scale, s.sliding_window, s.softcap,
                          self.sinks if s.has_sinks else None)
        out = out.reshape(t, -1)
        if gate is not None:
            out = out * mx.sigmoid(gate.reshape(t, -1))
        out = self.o_proj(out)
        if packed:
            out = out.reshape(1, t, -1)
        # K/V pass between layers through the pool, never as arrays: a sharing layer reads its
        # source's step object, so the K/V and offset handed back are None.
        return (out, None, None) if s.returns_kv else out


class LastTokenNorm(nn.Module):
    """The final norm, applied only to the rows whose logits are sampled (saves the LM head's work).

    The norm takes no ``cache`` argument, so the runner sets ``rows`` for the
    forward it is about to run and clears it after.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.rows: mx.array | None = None
        # Rows whose normed hidden state is itself the result (embed requests' last tokens):
        # kept aside in ``hidden`` and never sent through the LM head.
        self.hidden_rows: mx.array | None = None
        self.hidden: mx.array | None = None

    def __call__(self, h: mx.array) -> mx.array:
        rows = (slice(None),) * (h.ndim - 2)  # a flat stream's h is [T, hidden], a packed one's [1, T, hidden]
        if self.hidden_rows is not None:
            self.hidden = self.inner(h[rows + (self.hidden_rows,)])
        return self.inner(h[rows + (self.rows,)])


def install(model: nn.Module, specs: list[LayerSpec], backend: str = "auto") -> LastTokenNorm:
    """Swap every attention for a PagedAttention and every linear layer for its slotted form; join each MLP's
    gate and up projections.

    ``specs`` are ``model_layers.read_layers(model)``; returns the wrapped final norm.
    """
    layers = transformer_layers(model)
    recurrence = gated_delta.recurrence(kernels.resolve_backend(backend))
    for spec, layer in zip(specs, layers):
        if spec.linear is not None:
            layer.linear_attn = SlottedLinearAttention(spec.linear, recurrence)
        else:
            layer.self_attn = PagedAttention(layer.self_attn, spec.settings, backend, spec.kv_source is not None)
        # An MLP's gate and up projections as one matmul, one operation fewer per layer (LoRA's groups have
        # joined them already where adapters are on; experts' switch layers are not linears).
        for _, module in layer.named_modules():
            join_siblings(module, ("gate_proj", "up_proj"))
    inner_model = text_model(model).model
    norm = getattr(inner_model, "norm", None)
    if norm is None:
        raise ModelLoadError(f"{type(model).__module__}: no final norm found")
    inner_model.norm = LastTokenNorm(norm)
    return inner_model.norm


# The linears, rewritten once at install (see the module docstring).


def dims(linear: nn.Module) -> tuple[int, int]:
    """(in, out) of a dense or quantized linear (quantized weights pack 32 // bits inputs per word)."""
    out, packed = linear.weight.shape[-2:]
    return (packed * 32 // linear.bits if "scales" in linear else packed), out


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear whose output is ``parts``' outputs side by side, or None where they cannot be one:
    not all plain ``nn.Linear`` (or all ``nn.QuantizedLinear`` of one bit width, group size and mode),
    a bias on some only, or different input widths.

    Built from the first part with its arrays replaced by the concatenations, evaluated here so the
    parts' arrays are freed as soon as nothing else holds them.
    """
    kind = type(parts[0])
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(p) is not kind for p in parts):
        return None
    settings = ("group_size", "bits", "mode") if kind is nn.QuantizedLinear else ()
    names = ("weight", "scales", "biases") if kind is nn.QuantizedLinear else ("weight",)
    if any(getattr(p, k, None) != getattr(parts[0], k, None) for p in parts for k in settings):
        return None
    if len({"bias" in p for p in parts}) > 1 or len({p.weight.shape[1] for p in parts}) > 1:
        return None
    fused = copy.copy(parts[0])
    for name in names + (("bias",) if "bias" in parts[0] else ()):
        setattr(fused, name, mx.concatenate([p[name] for p in parts], axis=0))
    mx.eval(fused.parameters())
    return fused


class JoinedLinears:
    """The joined ``base`` of members whose outputs are ``outs`` wide, in order.

    The output is made at the first member's call and kept beside the array it
    was made from; members called with that same array (mlx_lm's attention and
    MLP pass one ``x``) take their slices, and the last one drops it, so no
    layer's input is held past its layer. A member called with another array
    gets an output made from that one: right for any model, merely slower for
    one that feeds its projections apart.

    The outputs are 2-D, ``[tokens, out]``, whatever the input's leading axes (the packed step's
    ``[1, T, in]``): a matmul of a 3-D input flattens and unflattens it, two graph nodes, and what
    follows the members (an MLP's activation and down projection, then the residual add, which
    broadcasts) takes 2-D as well.
    """

    def __init__(self, base: nn.Module, outs: list[int]):
        self.base = base
        self.offsets = list(itertools.accumulate(outs, initial=0))
        self._x: mx.array | None = None
        self._held: list[mx.array] | None = None
        self._left = 0

    def clear(self) -> None:
        self._x = self._held = None
        self._left = 0

    def joined(self, x: mx.array) -> mx.array:
        """Every member's output for ``x``, side by side."""
        return self.base(x)

    def output(self, x: mx.array, member: int) -> mx.array:
        if x is not self._x:
            n = len(self.offsets) - 1
            y = self.joined(x if x.ndim == 2 else x.reshape(-1, x.shape[-1]))
            # A wider output has columns past the members' (a LoRA group's x·A): cut off and dropped.
            cuts = self.offsets[1:] if y.shape[-1] > self.offsets[-1] else self.offsets[1:-1]
            self._held = mx.split(y, cuts, axis=-1) if cuts else [y]
            self._x, self._left = x, n
        held = self._held[member]
        self._left -= 1
        if self._left <= 0:
            self.clear()
        return held


class JoinedMember(nn.Module):
    """One member of a ``JoinedLinears``, called as the linear it replaced; the first member holds the joined
    linear in the module tree (``linear``)."""

    def __init__(self, joined: JoinedLinears, member: int):
        super().__init__()
        self.joined = joined  # a plain object, outside the module tree (its members share it)
        self.member = member
        if member == 0:
            self.linear = joined.base

    def __call__(self, x: mx.array) -> mx.array:
        return self.joined.output(x, self.member)


def join_siblings(parent: nn.Module, names: tuple[str, ...]) -> bool:
    """Replace ``parent``'s linears ``names`` (all present, joinable by ``fuse_linears``) by views of one
    joined linear; whether it did."""
    if not all(name in parent for name in names):
        return False
    parts = [parent[name] for name in names]
    base = fuse_linears(parts)
    if base is None:
        return False
    joined = JoinedLinears(base, [dims(p)[1] for p in parts])
    for i, name in enumerate(names):
        setattr(parent, name, JoinedMember(joined, i))
    return True


def _held(module: nn.Module) -> mx.array:
    """``module``'s weight's transpose, evaluated, kept beside it outside the parameters (so the memory guard
    and the checkpoint's paths see the module as before). A weight assigned anew is seen by identity and
    its view made again."""
    weight = module["weight"]
    if module.__dict__.get("_of") is not weight:
        view = weight.T
        mx.eval(view)
        object.__setattr__(module, "_of", weight)
        object.__setattr__(module, "_view", view)
    return module._view


class TransposedLinear(nn.Linear):
    """An ``nn.Linear`` multiplying by its held transpose."""

    def __call__(self, x: mx.array) -> mx.array:
        view = _held(self)
        return mx.addmm(self["bias"], x, view) if "bias" in self else x @ view


class TransposedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose use as the tied LM head multiplies by its held transpose."""

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ _held(self)


_HELD = {nn.Linear: TransposedLinear, nn.Embedding: TransposedEmbedding}


def hold_transposes(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` and ``nn.Embedding`` of ``model`` hold its weight's transpose; how many.

    Each instance keeps its identity (its class changes): a joined linear's
    members call it through a reference outside the module tree
    (``JoinedLinears.base``). Only for weights nothing writes into
    afterwards in place: LoRA's groups fold adapters into their bases' weights,
    so an engine with adapters does not call this.
    """
    modules = [m for _, m in model.named_modules() if type(m) in _HELD]
    for module in modules:
        module.__class__ = _HELD[type(module)]
        _held(module)
    return len(modules)
