"""A rendered prompt with images, through the model's own processor: token ids with each image's
placeholder expanded, and the pixels the engine's vision tower takes (``shared.protocol.ImageInput``).

The processor is transformers' (``AutoProcessor`` over the model's folder, offline); its image
processors take PIL images without torch. A folder whose ``preprocessor_config.json`` names no image
processor, and whose ``processor_config.json`` nests none (transformers 5's layout), has none: its
model takes no images, and a prompt with one is a 400 naming the model.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from mlxd.gateway.media import Image
from mlxd.gateway.placeholders import EXPANSIONS, PlaceholderExpansion, grid_arrays, patch_grids
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import ImageInput


@functools.lru_cache(maxsize=4)
def processor_for(tokenizer_dir: str):
    """The folder's processor, loaded once per folder; None when it has no image processor."""
    name = processor_class(Path(tokenizer_dir))
    if name is None:
        return None
    from transformers import AutoProcessor

    expansion = EXPANSIONS.get(name)
    if expansion is not None:  # a family whose placeholders mlxd writes (gateway/placeholders.py)
        return PlaceholderExpansion.load(tokenizer_dir, expansion)
    return AutoProcessor.from_pretrained(tokenizer_dir)


def processor_class(folder: Path) -> str | None:
    """The processor class a folder with an image processor names ("" unnamed); None without one."""
    pre, proc = (json.loads(p.read_text()) if p.is_file() else None
                 for p in (folder / "preprocessor_config.json", folder / "processor_config.json"))
    if pre is None and not isinstance((proc or {}).get("image_processor"), dict):
        return None
    return (pre or {}).get("processor_class") or (proc or {}).get("processor_class") or ""


def image_processor(tokenizer_dir: str, model: str):
    """(the folder's processor, the token id its images' rows go to); a 400 naming ``model`` when
    it takes no images."""
    processor = processor_for(tokenizer_dir)
    image_id = image_token_id(processor)
    if image_id is None:
        raise InvalidRequestError(f"the model `{model}` does not take images", param="messages")
    return processor, image_id


def image_token_id(processor) -> int | None:
    """The token id the processor's images' rows go to; None without one."""
    # The tokenizer's image token (Gemma 3's processor names its begin-of-image marker, which the
    # template writes, as the processor's own image token).
    image_id = getattr(getattr(processor, "tokenizer", None), "image_token_id", None)
    return image_id if image_id is not None else getattr(processor, "image_token_id", None)


def expand(tokenizer_dir: str, model: str, text: str, images: list[Image],
           max_pixels: int | None = None) -> tuple[list[int], list[ImageInput]]:
    """``text`` (the rendered template, one placeholder per image) as token ids with the images'
    tokens in place, and each image's pixels and place among them; blocking. ``max_pixels``: the
    engine's bound on an image after the processor's resize (``ModelInfo.max_image_pixels``)."""
    return expand_with(*image_processor(tokenizer_dir, model), text, images, max_pixels)


def expand_with(processor, image_id: int, text: str, images: list[Image],
                max_pixels: int | None = None) -> tuple[list[int], list[ImageInput]]:
    """``expand`` with the processor at hand.

    The processor says where each image's expansion lies in the expanded text; the token ids are
    mapped back to characters, so each image's span is the runs of the image token inside its own
    expansion (one run; or one per tile, or per row of patches, with the family's markers between).
    Its pixel arrays: one, or, when the processor made more arrays than images, one per run (a
    tiling processor writes each tile's tokens as a run of their own).
    """
    # Only the processors mlxd expands for take a bound (the engine states one for Qwen-VL's alone).
    bound = {"max_pixels": max_pixels} if max_pixels is not None else {}
    try:
        out = processor(text=text, images=[i.pil for i in images], add_special_tokens=False, return_tensors="np",
                        return_offsets_mapping=True, return_text_replacement_offsets=True, **bound)
    except ValueError as e:  # the template wrote a different number of placeholders than there are images
        raise InvalidRequestError(f"the images do not fit the prompt: {e}", param="messages") from None
    ids = np.asarray(out["input_ids"][0])
    chars = np.asarray(out["offset_mapping"][0])[:, 0]
    pixels = np.asarray(out["pixel_values"], dtype=np.float32)
    arrays = pixels[0] if pixels.ndim == 5 else pixels  # a tiling processor's [sample, array, C, H, W]
    if "image_sizes" in out:  # images of any size, padded to the batch's largest: each cut back to its own
        arrays = [a[:, :h, :w] for a, (h, w) in zip(arrays, np.asarray(out["image_sizes"]).tolist())]
    if "image_grid_thw" in out:  # every image's patches in one [patches, values]: each its [grid h, grid w, values]
        arrays = grid_arrays(pixels, np.asarray(out["image_grid_thw"]))
    if "image_position_ids" in out:  # each image's patches, padded to the most of the batch: each its [h, w, values]
        arrays = patch_grids(pixels, np.asarray(out["image_position_ids"]))
    expansions = out["text_replacement_offsets"][0]
    runs = []  # each image's runs of the image token: [start, end) token positions
    for expansion in expansions:
        first, end = expansion["new_span"]
        inside = (chars >= first) & (chars < end) & (ids == image_id)
        marks = np.flatnonzero(inside)
        breaks = np.flatnonzero(np.diff(marks) > 1)
        runs.append(list(zip(marks[np.r_[0, breaks + 1]], marks[np.r_[breaks, -1]] + 1)) if marks.size else [])
    one_each = len(arrays) == len(images)
    per_image = [1] * len(images) if one_each else [len(r) for r in runs]
    if len(expansions) != len(images) or not all(runs) or sum(per_image) != len(arrays):
        raise InvalidRequestError(f"the chat template placed {len(expansions)} image placeholders for "
                                  f"{len(images)} images", param="messages")
    inputs, at = [], 0
    for image, image_runs, n in zip(images, runs, per_image):
        start, end = int(image_runs[0][0]), int(image_runs[-1][1])
        px = arrays[at] if one_each else arrays[at : at + n]
        at += n
        inner = [[int(a) - start, int(b - a)] for a, b in image_runs] if len(image_runs) > 1 else None
        inputs.append(ImageInput(mm_hash=image.digest, offset=start, length=end - start, shape=list(px.shape),
                                 pixels=np.ascontiguousarray(px).tobytes(), runs=inner))
    return ids.tolist(), inputs
