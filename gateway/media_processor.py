"""A rendered prompt with images, through the model's own processor: token ids with each image's
placeholder expanded, and the pixels the engine's vision tower takes (``shared.protocol.ImageInput``).

The processor is transformers' (``AutoProcessor`` over the model's folder, offline); its image
processors take PIL images without torch. A folder without a ``preprocessor_config.json`` has no
image processor: its model takes no images, and a prompt with one is a 400 naming the model.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from mlxd.gateway.media import Image
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import ImageInput


@functools.lru_cache(maxsize=4)
def processor_for(tokenizer_dir: str):
    """The folder's processor, loaded once per folder; None when it has no image processor."""
    if not (Path(tokenizer_dir) / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tokenizer_dir)


def image_processor(tokenizer_dir: str, model: str):
    """(the folder's processor, the token id its images' rows go to); a 400 naming ``model`` when
    it takes no images."""
    processor = processor_for(tokenizer_dir)
    # The tokenizer's image token (Gemma 3's processor names its begin-of-image marker, which the
    # template writes, as the processor's own image token).
    image_id = getattr(getattr(processor, "tokenizer", None), "image_token_id", None)
    image_id = image_id if image_id is not None else getattr(processor, "image_token_id", None)
    if processor is None or image_id is None:
        raise InvalidRequestError(f"the model `{model}` does not take images", param="messages")
    return processor, image_id


def expand(tokenizer_dir: str, model: str, text: str, images: list[Image]) -> tuple[list[int], list[ImageInput]]:
    """``text`` (the rendered template, one placeholder per image) as token ids with the images'
    tokens in place, and each image's pixels and place among them; blocking."""
    processor, image_id = image_processor(tokenizer_dir, model)
    try:
        out = processor(text=text, images=[i.pil for i in images], add_special_tokens=False, return_tensors="np")
    except ValueError as e:  # the template wrote a different number of placeholders than there are images
        raise InvalidRequestError(f"the images do not fit the prompt: {e}", param="messages") from None
    ids = np.asarray(out["input_ids"][0])
    pixels = np.asarray(out["pixel_values"], dtype=np.float32)
    # Each image's tokens are one run of the image token.
    marks = np.flatnonzero(ids == image_id)
    starts = marks[np.r_[True, np.diff(marks) > 1]] if marks.size else marks
    if len(starts) != len(images) or len(pixels) != len(images):
        raise InvalidRequestError(f"the chat template placed {len(starts)} image placeholders for "
                                  f"{len(images)} images", param="messages")
    ends = np.r_[marks[np.flatnonzero(np.diff(marks) > 1)], marks[-1]] + 1
    inputs = [ImageInput(mm_hash=image.digest, offset=int(s), length=int(e - s), shape=list(px.shape),
                         pixels=np.ascontiguousarray(px).tobytes())
              for image, s, e, px in zip(images, starts, ends, pixels)]
    return ids.tolist(), inputs
