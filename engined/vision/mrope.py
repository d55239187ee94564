"""Qwen-VL's multi-axis RoPE (M-RoPE) over the packed step: three position ids per token.

A token's rotary frequencies are cut into sections (``mrope_section``: time, height, width); each
section rotates by its own axis's position. A text token's three positions are equal, so for a
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
    """The step's cos/sin table ``[T, 1, 1, head dim]`` (None: every row's axes are equal, and the
    text model's RoPE runs), shared by every layer's ``MRope``."""

    def __init__(self, sections: list[int], dims: int, base: float, merge: int):
        # Frequency j rotates by the position of axis axis_of[j]: the sections in order.
        self.axis_of = mx.array(np.repeat(np.arange(3), sections).astype(np.int32))
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
        positions = mx.array(np.concatenate(parts, axis=1).astype(np.int32))
        angles = positions[self.axis_of].T.astype(mx.float32) * self.inv_freq
        angles = mx.concatenate([angles, angles], axis=-1)[:, None, None, :]
        self.cos, self.sin = mx.cos(angles), mx.sin(angles)
        return True

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
        half = x.shape[-1] // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return (x * step.cos + rotated * step.sin).astype(x.dtype)


def install_mrope(model: nn.Module, vision_config) -> StepPositions | None:
    """Wrap each attention's RoPE in ``MRope`` when the checkpoint's text config has rotary sections
    (before ``runner.install``, which keeps the wrapped RoPE); the step table they share, or None
    for a model without M-RoPE."""
    scaling = getattr(vision_config.text_config, "rope_scaling", None) or {}
    sections = scaling.get("mrope_section")
    if not sections:
        return None
    attentions = [layer.self_attn for layer in transformer_layers(model)]
    rope = attentions[0].rope
    if type(rope) is not nn.RoPE or rope.traditional or 2 * sum(sections) != rope.dims:
        raise ModelLoadError(f"M-RoPE sections {list(sections)} need the text model's RoPE over "
                             f"{2 * sum(sections)} dimensions, rotating halves; it has {rope}")
    step = StepPositions(list(sections), rope.dims, rope.base, vision_config.vision_config.spatial_merge_size)
    for attention in attentions:
        attention.rope = MRope(attention.rope, step)
    return step
