"""Linear layers that add each token's own adapter's low-rank term: many adapters in one packed step.

Every wrapped linear is a member of a ``ProjectionGroup`` (``groups.py``):
q/k/v of one layer are one, gate/up one, any other linear a group of its
own. A group holds the resident adapters' A and B stacked by slot, ``S`` slots
of ``R`` columns per member (``S`` is ``--max-loras``, ``R`` is
``--max-lora-rank``; smaller ranks are zero-padded, the scale is folded into
``b``; the base model, slot 0, has no columns). The runner sets the step's
per-token slots on the shared ``LoraStep`` before a forward, which gives masks
with ones on each token's own slot's columns: a group's term is ``((x @ A) *
mask) @ B``, two dense matmuls over every resident slot, the second fused with
the base's output (``addmm``). One forward for the whole batch whatever its
mix of adapters, the base weights untouched, and no gather: MLX's
``gather_mm`` (what vLLM's punica kernels do) ran each row apart on CUDA,
100-170 us per projection on an H200 where the arithmetic is a few MFLOP
(bench/lora_results.md). The price is arithmetic on every resident slot's
columns, ``S * R`` of them per member (64 at 4 adapters of rank 16 against
4 096 outputs of Llama-8B's q_proj). A step with no adapter, or a group that
no resident adapter targets, skips the term.

Mixture-of-experts layers (mlx_lm's ``SwitchGLU``) hold one pair per slot
and expert, gathered by ``slot * experts + expert`` per routed row: their rows
are gathered for the base's own experts anyway.

Over 400 lines because each wrapper's form and the ``install`` that picks it for a family's module
are one mapping, read together.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu
from mlx_lm.models.switch_layers import SwitchGLU

from mlxd.engined.runner import JoinedMember, dims, fuse_linears
from mlxd.engined.lora.groups import ProjectionGroup
from mlxd.engined.model_layers import transformer_layers


class LoraStep:
    """What the runner sets for one forward (``set``): ``slots``, each packed token's uint32 slot, None on a step
    with no adapter, and ``mask(width)``, ``[tokens, S * width]`` with ones on each token's own slot's
    ``width`` columns. ``inputs`` are the layers' groups, whose held outputs a new step drops. ``term_kernel``:
    the groups add a decode step's terms with ``engined.kernels.lora_term`` (attention on CUDA)."""

    def __init__(self, num_adapters: int, dtype: mx.Dtype, term_kernel: bool = False):
        self.num_adapters = num_adapters
        self.dtype = dtype
        self.term_kernel = term_kernel
        self.slots: mx.array | None = None
        self.inputs: list[ProjectionGroup] = []
        self._host_slots = np.zeros(0, np.uint32)
        self._masks: dict[int, mx.array] = {}

    def set(self, slots: np.ndarray) -> None:
        for group in self.inputs:
            group.clear()
        self._masks = {}
        self._host_slots = slots
        self.slots = mx.array(slots) if slots.any() else None

    def mask(self, width: int) -> mx.array:
        """Ones where each token's own slot's ``width`` columns are (slot 1's first; the base has none), in the
        groups' 2-D ``[tokens, S * width]``: no group adds a broadcast or a reshape of its own."""
        if width not in self._masks:
            columns = np.repeat(np.arange(1, self.num_adapters + 1, dtype=np.uint32), width)
            self._masks[width] = mx.array(self._host_slots[:, None] == columns[None, :]).astype(self.dtype)
        return self._masks[width]


def _padded(pair, a_shape: tuple, b_shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """An adapter's ``(a, b)`` in the corner of zeros of a slot's shapes (smaller rank, fewer experts); zeros
    for None."""
    a, b = np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32)
    if pair is not None:
        pa, pb = pair
        a[tuple(slice(0, n) for n in pa.shape)] = pa
        b[tuple(slice(0, n) for n in pb.shape)] = pb
    return a, b


class SlottedLoraLinear(JoinedMember):
    """One member of a ``ProjectionGroup``, called as the linear it replaces: its slice of the group's output.
    The group's first member holds the group's arrays in the module tree (``linear``, ``lora_a``,
    ``lora_b``)."""

    def __init__(self, group: ProjectionGroup, member: int, input_dims: int, output_dims: int):
        super().__init__(group, member)
        self.input_dims, self.output_dims = input_dims, output_dims
        if member == 0:
            self.lora_b = group.b
            if group.a is not None:
                self.lora_a = group.a

    def expected_shapes(self, rank: int) -> tuple[tuple, tuple]:
        return (self.input_dims, rank), (rank, self.output_dims)

    @property
    def nbytes(self) -> int:
        """Bytes of the slots' A and B this member holds (a group's are its first member's)."""
        return self.joined.nbytes if self.member == 0 else 0

    def stacks(self) -> list[mx.array]:
        """The arrays that hold this member's slots (a group's are its first member's): B, and A or the
        folded base's weight."""
        return self.joined.arrays() if self.member == 0 else []

    def write(self, slot: int, pair: tuple[np.ndarray, np.ndarray] | None) -> list[mx.array]:
        """Put an adapter's ``(a, b)`` (None: it adapts nothing here) into ``slot``; the arrays changed."""
        r = self.joined.rank
        a, b = _padded(pair, (self.input_dims, r), (r, self.output_dims))
        self.joined.write(self.member, slot, a, b, pair is not None)
        return self.joined.arrays()


def _sort_rows(x: mx.array, indices: mx.array):
    """Routed rows sorted by expert, as mlx_lm's SwitchGLU sorts them, and each row's source token."""
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // k], flat[order], order // k, mx.argsort(order)


class SlottedLoraSwitchGLU(nn.Module):
    """mlx_lm's SwitchGLU (same projections, routing and sort) with per-token adapters on its three projections.

    Stacks by ``slot * experts + expert``; gate_proj's and up_proj's A share one
    stack (``gate_up_a``, gate's columns first), as a dense layer's do in its
    ``ProjectionGroup``: one product of the routed rows for both.
    """

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, inner: SwitchGLU, step: LoraStep, num_slots: int, rank: int, dtype: mx.Dtype):
        super().__init__()
        self.inner = inner
        self.step = step
        self.rank = rank
        self.num_experts = inner.gate_proj.weight.shape[0]
        self.dims = {name: dims(getattr(inner, name)) for name in self.PROJECTIONS}
        n = num_slots * self.num_experts
        d_in = self.dims["gate_proj"][0]
        self.gate_up_a = mx.zeros((n, d_in, 2 * rank), dtype)
        self.down_proj_a = mx.zeros((n, self.dims["down_proj"][0], rank), dtype)
        for name in self.PROJECTIONS:
            setattr(self, f"{name}_b", mx.zeros((n, rank, self.dims[name][1]), dtype))
        # Per projection, the slots whose adapter targets it; set past nn.Module's __setattr__, which would
        # make a dict part of the module tree.
        object.__setattr__(self, "live_slots", {name: set() for name in self.PROJECTIONS})

    def expected_shapes(self, name: str, rank: int) -> tuple[tuple, tuple]:
        d_in, d_out = self.dims[name]
        return (self.num_experts, d_in, rank), (self.num_experts, rank, d_out)

    def stacks(self) -> list[mx.array]:
        return [v for v in self.values() if isinstance(v, mx.array)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.stacks())

    def write(self, name: str, slot: int, pair: tuple[np.ndarray, np.ndarray] | None) -> list[mx.array]:
        """Put an adapter's ``(a, b)`` for projection ``name`` (None: none) into ``slot``; the arrays changed."""
        e, r = self.num_experts, self.rank
        d_in, d_out = self.dims[name]
        a, b = _padded(pair, (e, d_in, r), (e, r, d_out))
        if pair is None:
            self.live_slots[name].discard(slot)
        else:
            self.live_slots[name].add(slot)
        rows = slice(slot * e, (slot + 1) * e)
        if name == "down_proj":
            stack_a, cols = self.down_proj_a, slice(0, r)
        else:
            stack_a, cols = self.gate_up_a, slice(0, r) if name == "gate_proj" else slice(r, 2 * r)
        stack_a[rows, :, cols] = mx.array(a).astype(stack_a.dtype)
        stack_b = self[f"{name}_b"]
        stack_b[rows] = mx.array(b).astype(stack_b.dtype)
        return [stack_a, stack_b]

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        slots = self.step.slots
        live = self.live_slots
        if slots is None or not any(live.values()):
            return self.inner(x, indices)
        inner, r = self.inner, self.rank
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= 64
        if do_sort:
            x, idx, token, inv = _sort_rows(x, indices)
            rows = slots[token] * self.num_experts + idx
        else:
            idx = indices
            rows = slots.reshape(indices.shape[:-1] + (1,)) * self.num_experts + idx

        def project(name, h, h_a):
            """The projection of ``h`` plus its term from ``h_a``, its rows' ``h·A`` (None: no term)."""
            y = getattr(inner, name)(h, idx, sorted_indices=do_sort)
            if h_a is None or not live[name]:
                return y
            return y + mx.gather_mm(h_a, self[f"{name}_b"], rhs_indices=rows).astype(y.dtype)

        xa = None
        if live["gate_proj"] or live["up_proj"]:
            xa = mx.gather_mm(x.astype(self.gate_up_a.dtype), self.gate_up_a, rhs_indices=rows)
        gate = project("gate_proj", x, None if xa is None else xa[..., :r])
        up = project("up_proj", x, None if xa is None else xa[..., r:])
        h = inner.activation(up, gate)
        ha = None
        if live["down_proj"]:
            ha = mx.gather_mm(h.astype(self.down_proj_a.dtype), self.down_proj_a, rhs_indices=rows)
        out = project("down_proj", h, ha)
        if do_sort:
            out = mx.unflatten(out[inv], 0, indices.shape)
        return out.squeeze(-2)


class SwiGLUMLP(nn.Module):
    """An MLP of mlx_lm's ``down_proj(swiglu(gate_proj(x), up_proj(x)))`` form whose gate/up are one group: its
    hidden state is the group's in one piece (``ProjectionGroup.joined(glu=True)``), so that where the term kernel
    runs one launch adds both terms and applies the activation. Same modules under the same names."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, inner: nn.Module, group: ProjectionGroup):
        super().__init__()
        for name in self.PROJECTIONS:
            setattr(self, name, inner[name])
        self.group = group  # a plain object, outside the module tree

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.group.joined(x.reshape(-1, x.shape[-1]), glu=True))


def _swiglu_form(mlp: nn.Module) -> bool:
    """Whether ``mlp`` computes ``down_proj(swiglu(gate_proj(x), up_proj(x)))``: checked on a random input in its
    weights' dtype, before its linears are wrapped (another activation, a gate scale or a shared expert differs)."""
    if not all(name in mlp for name in SwiGLUMLP.PROJECTIONS):
        return False
    gate = mlp.gate_proj
    dtype = gate.scales.dtype if "scales" in gate else gate.weight.dtype
    x = mx.random.normal((2, dims(gate)[0]), key=mx.random.key(0)).astype(dtype)
    try:
        want = mlp(x).astype(mx.float32)
        got = mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x))).astype(mx.float32)
        return want.shape == got.shape and (mx.abs(want - got).max() <= 1e-2 * mx.abs(want).max()).item()
    except (ValueError, TypeError, AttributeError):  # not called as a plain function of one array
        return False


class ResidualBlock:
    """A decoder layer of mlx_lm's ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` form (checked with stand-ins
    for its attention and MLP at install: ``_residual_form``), mixed into its own class: each branch that ends in
    a group of one (the attention's o_proj, a ``SwiGLUMLP``'s down_proj) is handed the input it is added to
    (``ProjectionGroup.residual``), so that the addition is the group's, inside the term kernel where that runs.
    The engine's attention (``engined.runner.PagedAttention``) returns its o_proj's output as it is.
    ``residual_groups``: (the attention's group or None, the MLP's or None)."""

    residual_groups: tuple[ProjectionGroup | None, ProjectionGroup | None]

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        attn, mlp = self.residual_groups
        h = _added(attn, x, lambda: self.self_attn(self.input_layernorm(x), mask, cache))
        return _added(mlp, h, lambda: self.mlp(self.post_attention_layernorm(h)))


def _added(group: ProjectionGroup | None, residual: mx.array, branch) -> mx.array:
    """``residual + branch()``, the addition made by ``group`` where the branch ends in it."""
    if group is None:
        return residual + branch()
    group.residual = residual.reshape(-1, residual.shape[-1])
    out = branch()
    if group.residual is not None:  # the branch never reached its group: add here
        group.residual = None
        return residual + out
    return out.reshape(residual.shape)


class _Scaled(nn.Module):
    """A stand-in branch for ``_residual_form``: its input times ``factor``, whatever else it is passed."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return x * self.factor


def _residual_form(layer: nn.Module) -> bool:
    """Whether ``layer(x, mask, cache)`` is ``h = x + self_attn(input_layernorm(x))`` then
    ``h + mlp(post_attention_layernorm(h))``: checked with stand-ins for its attention and MLP (scalings) on a
    random input."""
    names = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    if not all(name in layer for name in names):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    stand_in = (_Scaled(0.5), _Scaled(0.25))
    try:
        x = mx.random.normal((1, 2, layer.input_layernorm.weight.shape[-1]), key=mx.random.key(1))
        layer.self_attn, layer.mlp = stand_in
        got = layer(x, None, None)
        h = x + stand_in[0](layer.input_layernorm(x))
        want = h + stand_in[1](layer.post_attention_layernorm(h))
        return isinstance(got, mx.array) and got.shape == want.shape and mx.allclose(got, want, atol=1e-3).item()
    except (ValueError, TypeError, AttributeError):  # another signature or form
        return False
    finally:
        layer.self_attn, layer.mlp = attn, mlp


@lru_cache(maxsize=None)
def _with_residual(cls: type) -> type:
    return type(cls.__name__, (ResidualBlock, cls), {})


def _lone_group(module: nn.Module | None) -> ProjectionGroup | None:
    """``module``'s group where it is a wrapped linear alone in its group."""
    if isinstance(module, SlottedLoraLinear) and len(module.joined.offsets) == 2:
        return module.joined
    return None


_LINEARS = (nn.Linear, nn.QuantizedLinear)
# Sibling projections that mlx_lm's attention and MLP blocks call on one input: one ProjectionGroup each.
_SHARED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def install(model: nn.Module, num_adapters: int, rank: int, dtype: mx.Dtype, expert_dtype: mx.Dtype | None = None,
            term_kernel: bool = False):
    """Wrap every linear and SwitchGLU of the transformer layers for ``num_adapters`` resident adapters of rank
    up to ``rank``; returns the step and the targets. Slots are in ``dtype``, an expert layer's in
    ``expert_dtype`` (default ``dtype``: MLX's CPU ``gather_mm`` takes float32 only).

    ``targets[path] = (wrapper, projection)``: paths are mlx_lm's from the model's
    root (``model.layers.0.self_attn.q_proj``), the names adapters use; a
    SwitchGLU's three projections (``...switch_mlp.gate_proj``) share its
    wrapper and name their ``projection``, a linear's is None. A SwitchGLU's
    projections are switch layers, not linears, so they are never wrapped twice.
    Sibling q/k/v (and gate/up) linears of one input size are one ``ProjectionGroup``
    where ``fuse_linears`` can join them; every other linear is a group of its own. Linear-attention layers of hybrid
    models keep their own projections (their recurrent state is not adapted).
    """
    step = LoraStep(num_adapters, dtype, term_kernel)
    layers = transformer_layers(model)
    prefix = "model.layers" if getattr(getattr(model, "model", None), "layers", None) is layers else "layers"
    targets: dict[str, tuple[nn.Module, str | None]] = {}
    for i, layer in enumerate(layers):
        switches, groups = [], {}
        for name, module in layer.named_modules():
            if name.startswith("linear_attn") or not name:
                continue
            if isinstance(module, SwitchGLU):
                switches.append((name, SlottedLoraSwitchGLU(module, step, num_adapters + 1, rank,
                                                             expert_dtype or dtype)))
            elif isinstance(module, _LINEARS):
                parent, _, leaf = name.rpartition(".")
                key = (parent, _SHARED[leaf], dims(module)[0]) if leaf in _SHARED else (name,)
                groups.setdefault(key, []).append((name, module))
        swaps, mlps = list(switches), []
        for key, members in groups.items():
            members.sort(key=lambda m: m[0])  # gate_proj before up_proj
            joined = fuse_linears([m for _, m in members]) if len(members) > 1 else None
            if joined is not None and key[1] == "gate_up" and _swiglu_form(_get(layer, key[0])):
                mlps.append(key[0])
            for part in [members] if joined is not None or len(members) == 1 else [[m] for m in members]:
                shapes = [dims(m) for _, m in part]  # before the group folds A into a lone base's weight
                group = ProjectionGroup(step, part[0][1] if joined is None else joined,
                                        [out for _, out in shapes], num_adapters, rank, dtype)
                swaps += [(name, SlottedLoraLinear(group, j, *shapes[j])) for j, (name, _) in enumerate(part)]
        for name, wrapper in swaps:
            _set(layer, name, wrapper)
            if isinstance(wrapper, SlottedLoraSwitchGLU):
                for proj in SlottedLoraSwitchGLU.PROJECTIONS:
                    targets[f"{prefix}.{i}.{name}.{proj}"] = (wrapper, proj)
            else:
                targets[f"{prefix}.{i}.{name}"] = (wrapper, None)
        for name in mlps:
            mlp = _get(layer, name)
            _set(layer, name, SwiGLUMLP(mlp, mlp.gate_proj.joined))
        attn = _lone_group(getattr(layer.get("self_attn"), "o_proj", None))
        mlp = _lone_group(layer["mlp"].down_proj) if isinstance(layer.get("mlp"), SwiGLUMLP) else None
        if (attn or mlp) and _residual_form(layer):
            layer.__class__ = _with_residual(type(layer))
            object.__setattr__(layer, "residual_groups", (attn, mlp))  # plain objects, outside the module tree
    return step, targets


def _get(root: nn.Module, dotted: str) -> nn.Module:
    for p in dotted.split(".") if dotted else []:
        root = root[int(p)] if p.isdigit() else getattr(root, p)
    return root


def _set(root: nn.Module, dotted: str, module: nn.Module) -> None:
    *parents, last = dotted.split(".")
    root = _get(root, ".".join(parents))
    if last.isdigit():
        root[int(last)] = module
    else:
        setattr(root, last, module)
