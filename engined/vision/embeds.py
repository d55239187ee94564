"""The image rows of a packed step, and the encoder output cache that keeps them across its chunks.

A prompt's image fills ``length`` consecutive prompt positions; a step computes some run of a
request's positions, which may start or end inside an image (chunked prefill cuts where the
token budget ends, and a prefix-cache hit may end inside one). The tower runs once per image,
for every image a step needs that the cache does not hold, batched by pixel shape; the rows are
kept, keyed by the image's content hash, so that the image's later chunks, a preempted request's
recomputation and another request with the same image read them again instead of re-encoding.
The cache is bounded in bytes (its budget is a fixed pool of the memory guard's) and evicts least
recently used images first, never one the step at hand needs. The tower runs on at most
``ENCODE_BATCH`` images at a time, so that its activations stay within the room the memory guard
sets aside for them.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import numpy as np

from mlxd.engined.vision.tower import VisionTower
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import ImageInput

# Images per tower call: a step's images are encoded together, this many at a time.
ENCODE_BATCH = 8


class ImageEmbeds:
    """Rows of image embeddings for the positions a step computes; ``fixed_bytes`` is the cache's budget."""

    bytes_per_block = resize_bytes_per_block = 0  # a memory guard store that holds no K/V

    def __init__(self, tower: VisionTower, budget_tokens: int, hidden_size: int):
        self.tower = tower
        self.budget = budget_tokens * hidden_size * tower.dtype.size
        self._cache: OrderedDict[str, mx.array] = OrderedDict()
        self._cached_bytes = 0

    @property
    def fixed_bytes(self) -> int:
        """The cache's budget, and the activations of a full batch of the largest images."""
        return self.budget + ENCODE_BATCH * self.tower.activation_bytes

    def step_rows(self, scheduled: list) -> tuple[mx.array, mx.array] | None:
        """(packed positions [k], rows [k, hidden]) of the image tokens among the step's pieces;
        None when it computes none. ``scheduled``: the batch's (request, n) in packed order, each
        computing its positions ``num_computed_tokens`` to ``+ n``."""
        spans = []  # (image, first row, end row, packed position of the first row)
        offset = 0
        for r, n in scheduled:
            start = r.num_computed_tokens
            for image in r.images or ():
                lo, hi = max(start, image.offset), min(start + n, image.offset + image.length)
                if lo < hi:
                    spans.append((image, lo - image.offset, hi - image.offset, offset + lo - start))
            offset += n
        if not spans:
            return None
        features = self._features([s[0] for s in spans])
        rows = mx.concatenate([features[image.mm_hash][a:b] for image, a, b, _ in spans])
        positions = np.concatenate([np.arange(at, at + b - a) for _, a, b, at in spans]).astype(np.int32)
        return mx.array(positions), rows

    def _features(self, images: list[ImageInput]) -> dict[str, mx.array]:
        """Each image's ``[length, hidden]`` rows, from the cache or encoded now (the missing ones in
        one tower call per pixel shape)."""
        found = {}
        missing: dict[tuple, dict[str, ImageInput]] = {}
        for image in images:
            if image.mm_hash in self._cache:
                self._cache.move_to_end(image.mm_hash)
                found[image.mm_hash] = self._cache[image.mm_hash]
            elif image.mm_hash not in found:
                missing.setdefault(tuple(image.shape), {})[image.mm_hash] = image
        for shape, group in missing.items():
            hashes = list(group)
            for at in range(0, len(hashes), ENCODE_BATCH):
                batch = hashes[at : at + ENCODE_BATCH]
                pixels = mx.array(np.stack([np.frombuffer(group[h].pixels, dtype=np.float32).reshape(shape)
                                            for h in batch]))
                out = self.tower.encode(pixels)
                # Each image's rows in an array of its own, so that evicting one frees its memory.
                rows = [mx.contiguous(out[k]) for k in range(len(batch))]
                mx.eval(rows)
                found.update(zip(batch, rows))
        for h, rows in found.items():
            if h not in self._cache:
                self._cache[h] = rows
                self._cached_bytes += rows.nbytes
        self._evict(keep=found)
        return found

    def _evict(self, keep: dict) -> None:
        while self._cached_bytes > self.budget:
            h = next((h for h in self._cache if h not in keep), None)
            if h is None:  # the step's own images exceed the budget: kept until a later step
                return
            self._cached_bytes -= self._cache.pop(h).nbytes


def image_embeds(tower: VisionTower | None, config) -> ImageEmbeds | None:
    """The step's image rows for a model with a tower: its cache holds a step's worth of rows
    (``max_num_batched_tokens``), as vLLM sizes its encoder cache."""
    if tower is None:
        return None
    return ImageEmbeds(tower, config.max_num_batched_tokens, tower.config.text_config.hidden_size)


def check_images(images: list[ImageInput], num_prompt_tokens: int, embeds: ImageEmbeds | None, model: str) -> None:
    """Raise InvalidRequestError unless every image lies inside the prompt, in order, on a model with a tower."""
    if embeds is None:
        raise InvalidRequestError(f"the model `{model}` does not take images")
    end = 0
    for image in images:
        if image.offset < end or image.length <= 0 or image.offset + image.length > num_prompt_tokens:
            raise InvalidRequestError("an image's placeholder tokens lie outside the prompt or overlap another's")
        if len(image.shape) != 3 or int(np.prod(image.shape)) * 4 != len(image.pixels):
            raise InvalidRequestError("an image's pixels do not fill its shape")
        if embeds.tower.num_tokens(image.shape) != image.length:
            raise InvalidRequestError(f"an image of this model fills {embeds.tower.num_tokens(image.shape)} "
                                      f"placeholder tokens, not {image.length}")
        end = image.offset + image.length
