"""The image placeholders of families whose transformers processor cannot be built here, expanded
by mlxd: the folder's image processor and tokenizer, and each family's count of tokens per image.

transformers' Qwen2.5-VL, Qwen3-VL (Qwen3.5's) and Gemma 4 processors build a video processor that
needs torchvision, which mlxd does not install, and Pixtral's (Mistral 3) needs it too; their image processor and
tokenizer need neither. The template writes one image token per image (Qwen's inside its begin
and end markers); the expansion repeats it once per row the tower makes (Pixtral's with its row
breaks and end marker, Gemma 4's between begin and end markers it adds), and returns what
``media_processor.expand_with`` reads from a transformers processor: token ids, their character
offsets, where each image's expansion lies in the expanded text, and the image processor's own
outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np


def _merged_patches(out: dict, image_processor) -> list[str]:
    # Qwen-VL: an image is t x h x w patches, merged merge x merge into one row.
    return ["<|image_pad|>" * (int(np.prod(grid)) // image_processor.merge_size ** 2)
            for grid in np.asarray(out["image_grid_thw"])]


def _pixtral_rows(out: dict, image_processor) -> list[str]:
    # Pixtral: a row of image tokens per row of merged patches, a break after each row, the last
    # break an end marker.
    side = image_processor.patch_size["height"]
    rows = [("[IMG]" * (w // side) + "[IMG_BREAK]") * (h // side) for h, w in np.asarray(out["image_sizes"]).tolist()]
    return [r[: -len("[IMG_BREAK]")] + "[IMG_END]" for r in rows]


def _pixtral_patch(folder: Path) -> dict:
    # The image processor resizes to whole merged patches: its patch times the projector's merge,
    # which processor_config.json (or the model's config.json) holds.
    def read(name: str) -> dict:
        return json.loads((folder / name).read_text()) if (folder / name).is_file() else {}

    settings = {"spatial_merge_size": read("config.json").get("spatial_merge_size", 1), **read("processor_config.json")}
    side = settings.get("patch_size", 16) * settings["spatial_merge_size"]
    return {"patch_size": {"height": side, "width": side}}


def _gemma4_soft_tokens(out: dict, image_processor) -> list[str]:
    # Gemma 4: the image's pooled rows between its begin and end markers (Gemma 4's tokenizer's).
    return [f"<|image>{'<|image|>' * int(n)}<image|>" for n in out["num_soft_tokens_per_image"]]


@dataclass(frozen=True)
class Expansion:
    image_token: str
    write: Callable  # (image processor's outputs, image processor) -> each image's expansion, as text
    loaded_with: Callable = lambda folder: {}  # (folder) -> what the image processor is loaded with


# Keyed by the processor class the folder names (``media_processor.processor_class``).
EXPANSIONS = {
    "Qwen2_5_VLProcessor": Expansion("<|image_pad|>", _merged_patches),
    # Qwen3.5's checkpoints name Qwen3-VL's processor: an image's placeholders as Qwen2.5-VL's.
    "Qwen3VLProcessor": Expansion("<|image_pad|>", _merged_patches),
    # Mistral 3's: torchvision for the processor, though its image processor runs on PIL alone.
    "PixtralProcessor": Expansion("[IMG]", _pixtral_rows, _pixtral_patch),
    # Gemma 4's: torchvision for its video processor; its image processor runs on PIL alone.
    "Gemma4Processor": Expansion("<|image|>", _gemma4_soft_tokens),
}


def grid_arrays(pixels: np.ndarray, grids: np.ndarray) -> list[np.ndarray]:
    """Every image's patches of ``pixels [patches, values]`` (images in order, ``grids [n, 3]`` of
    t, h, w patches each), as ``[t * h, w, values]``: its shape carries the grid to the engine."""
    ends = np.cumsum(np.prod(grids, axis=1))
    return [p.reshape(int(g[0] * g[1]), int(g[2]), -1) for p, g in zip(np.split(pixels, ends[:-1]), grids)]


def patch_grids(pixels: np.ndarray, positions: np.ndarray) -> list[np.ndarray]:
    """Each image's patches of ``pixels [images, patches, values]`` (padded to the batch's most,
    ``positions [images, patches, 2]`` their x, y and -1 past an image's own), as ``[h, w, values]``."""
    grids = []
    for p, xy in zip(pixels, positions):
        real = xy[:, 0] >= 0
        grids.append(p[real].reshape(int(xy[real, 1].max()) + 1, int(xy[real, 0].max()) + 1, -1))
    return grids


class PlaceholderExpansion:
    """A processor for one of ``EXPANSIONS``: called as transformers' processors are by
    ``media_processor.expand_with``."""

    def __init__(self, image_processor, tokenizer, expansion: Expansion):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.expansion = expansion
        self.image_token_id = tokenizer.convert_tokens_to_ids(expansion.image_token)

    @classmethod
    def load(cls, folder: str, expansion: Expansion) -> "PlaceholderExpansion":
        from transformers import AutoImageProcessor, AutoTokenizer

        image_processor = AutoImageProcessor.from_pretrained(folder, **expansion.loaded_with(Path(folder)))
        return cls(image_processor, AutoTokenizer.from_pretrained(folder), expansion)

    def __call__(self, text: str, images: list | None = None, return_offsets_mapping: bool = False,
                 return_text_replacement_offsets: bool = False, max_pixels: int | None = None, **_) -> dict:
        token = self.expansion.image_token
        pieces = text.split(token)
        images = images or []
        if len(pieces) != len(images) + 1:
            raise ValueError(f"the text holds {len(pieces) - 1} image tokens for {len(images)} images")
        out = dict(self.image_processor(images=images, return_tensors="np", **self._bounded(max_pixels))) \
            if images else {}
        expanded, spans = pieces[0], []
        for written, piece in zip(self.expansion.write(out, self.image_processor) if images else [], pieces[1:]):
            spans.append({"new_span": (len(expanded), len(expanded) + len(written))})
            expanded += written + piece
        encoded = self.tokenizer(expanded, add_special_tokens=False, return_offsets_mapping=return_offsets_mapping,
                                 return_tensors="np")
        out.update(encoded)
        if return_text_replacement_offsets:
            out["text_replacement_offsets"] = [spans]
        return out

    def _bounded(self, max_pixels: int | None) -> dict:
        # Qwen2-VL's image processor resizes each image to whole merged patches within its size's
        # pixel range (transformers 5 takes the range as size at call time): the engine's bound caps it.
        if max_pixels is None:
            return {}
        size = self.image_processor.size
        return {"size": {"shortest_edge": min(size["shortest_edge"], max_pixels),
                         "longest_edge": min(size["longest_edge"], max_pixels)}}
