"""Qwen-VL's multi-axis RoPE (M-RoPE) over the packed step: three position ids per token.

A token's rotary frequencies are shared out among the three axes (``mrope_section``: how many
frequencies time, height and width take); each rotates by its own axis's position. Qwen2.5-VL's
layout gives each axis one run of frequencies in turn, Qwen3.5's interleaves them (height and width
on every third frequency while their counts last, time on the rest): ``LAYOUTS``, which axis each
frequency reads, is the only difference. A text token's three positions are equal, so for a
request without images M-RoPE is the text model's own RoPE. An image's rows take the image's
grid: from the position its first row would have had as text, time stays, height and width count
its merged patch rows and columns; the text after it resumes one past the largest of those. So
every position after an image is its sequence index plus a per-request shift, the shift growing
by ``max(h, w) - h * w`` per image.

The request's positions are computed from its images (each ``ImageInput``'s shape is its grid,
``[h, w, patch values]``) for the rows a step computes, once per step and only for the requests
that carry images; a step without any such request runs the text model's RoPE untouched (and the
compiled decode replay). The positions become one cos/sin table of the step, which every layer's
``MRope`` reads.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.engined.model_layers import transformer_layers
from mlxd.shared.errors import ModelLoadError
from mlxd.shared.protocol import ImageInput


def _sectioned(sections: list[int], freqs: int) -> np.ndarray:
    return np.repeat(np.arange(3), sections)


def _interleaved(sections: list[int], freqs: int) -> np.ndarray:
    axis = np.zeros(freqs, np.int64)
    axis[1 : 3 * sections[1] : 3] = 1
    axis[2 : 3 * sections[2] : 3] = 2
    return axis


# Layout name (the vision family's ``mrope``) -> (sections, rotary frequencies) -> the axis each frequency reads.
LAYOUTS = {"sectioned": _sectioned, "interleaved": _interleaved}


def request_positions(images: list[ImageInput], merge: int, start: int, n: int) -> np.ndarray:
    """``[3, n]`` (time, height, width) positions of a request's rows ``start`` to ``start + n``;
    ``images`` in prompt order, each spanning its merged grid's ``h * w`` rows."""
    index = np.arange(start, start + n)
    out = np.broadcast_to(index, (3, n)).copy()
    shift = 0
    for image in images:
        if image.offset >= start + n:
            break
        h, w = image.shape[0] // merge, image.shape[1] // merge
        k = index - image.offset
        inside = (k >= 0) & (k < h * w)
        if inside.any():
            first = image.offset + shift
            out[0, inside] = first
            out[1, inside] = first + k[inside] // w
            out[2, inside] = first + k[inside] % w
        shift += max(h, w) - h * w
        after = k >= h * w
        out[:, after] = index[after] + shift
    return out


class StepPositions:
    """The step's cos/sin table ``[T, 1, 1, rotated dims]`` (None: every row's axes are equal, and the
    text model's RoPE runs), shared by every layer's ``MRope``."""

    def __init__(self, axis_of: np.ndarray, dims: int, base: float, merge: int):
        # Frequency j rotates by the position of axis axis_of[j] (one of ``LAYOUTS``).
        self.axis_of = mx.array(axis_of.astype(np.int32))
        self.dims = dims
        self.inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2).astype(mx.float32) / dims))
        self.merge = merge
        self.cos = self.sin = None

    def set_step(self, scheduled: list) -> bool:
        """Build the table for ``scheduled`` (the batch's (request, n) in packed order); False,
        and no table, when none of them has images."""
        if not any(r.images for r, _ in scheduled):
            return False
        parts = [request_positions(r.images, self.merge, r.num_computed_tokens, n) if r.images
                 else np.broadcast_to(np.arange(r.num_computed_tokens, r.num_computed_tokens + n), (3, n))
                 for r, n in scheduled]
        self.set_positions(np.concatenate(parts, axis=1))
        return True

    def set_positions(self, positions: np.ndarray) -> None:
        """The table for the step's rows' ``[3, T]`` (time, height, width) positions."""
        positions = mx.array(positions.astype(np.int32))
        angles = positions[self.axis_of].T.astype(mx.float32) * self.inv_freq
        angles = mx.concatenate([angles, angles], axis=-1)[:, None, None, :]
        self.cos, self.sin = mx.cos(angles), mx.sin(angles)

    def clear(self) -> None:
        self.cos = self.sin = None


class MRope(nn.Module):
    """A layer's RoPE: the step's M-RoPE table when it has one, else the text model's own ``inner``."""

    def __init__(self, inner: nn.Module, step: StepPositions):
        super().__init__()
        self.inner = inner
        self._step = step  # not a child module: one table for every layer

    def __call__(self, x: mx.array, offset) -> mx.array:
        step = self._step
        if step.cos is None:
            return self.inner(x, offset=offset)
        dims = step.dims  # a partial RoPE (Qwen3.5's) rotates the first dims and passes the rest
        rot, half = x[..., :dims], dims // 2
        rotated = mx.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
        out = (rot * step.cos + rotated * step.sin).astype(x.dtype)
        return out if dims == x.shape[-1] else mx.concatenate([out, x[..., dims:]], axis=-1)


def install_mrope(model: nn.Module, vision_config) -> StepPositions | None:
    """Wrap each attention's RoPE in ``MRope`` when the checkpoint's text config has rotary sections
    (before ``runner.install``, which keeps the wrapped RoPE); the step table they share, or None
    for a model without M-RoPE."""
    from mlxd.engined.vision.tower import FAMILIES

    text = vision_config.text_config  # Qwen2.5-VL states its sections in rope_scaling, Qwen3.5 in rope_parameters
    scaling = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    sections = scaling.get("mrope_section")
    layout = FAMILIES[vision_config.model_type].mrope
    if not sections or not layout:
        return None
    # A hybrid's linear-attention layers (Qwen3.5's gated delta nets) take no positions.
    attentions = [layer.self_attn for layer in transformer_layers(model) if "self_attn" in layer]
    rope = attentions[0].rope
    if type(rope) is not nn.RoPE or rope.traditional or 2 * sum(sections) != rope.dims:
        raise ModelLoadError(f"M-RoPE sections {list(sections)} need the text model's RoPE over "
                             f"{2 * sum(sections)} dimensions, rotating halves; it has {rope}")
    axis_of = LAYOUTS[layout](list(sections), rope.dims // 2)
    step = StepPositions(axis_of, rope.dims, rope.base, vision_config.vision_config.spatial_merge_size)
    for attention in attentions:
        attention.rope = MRope(attention.rope, step)
    return step
