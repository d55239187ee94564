"""The image rows of a packed step, and the encoder output cache that keeps them across its chunks.

A prompt's image spans ``length`` consecutive prompt positions, of which its ``runs`` take the
tower's rows (all of them, or the runs between a family's row breaks and tile markers); a step
computes some run of a request's positions, which may start or end inside an image (chunked
prefill cuts where the token budget ends, and a prefix-cache hit may end inside one). The tower
runs once per image, for every image a step needs that the cache does not hold, over the pixel
arrays of all those images (one per image, or one per tile) batched by shape; the rows are
kept, keyed by the image's content hash, so that the image's later chunks, a preempted request's
recomputation and another request with the same image read them again instead of re-encoding.
The cache is bounded in bytes (its budget is a fixed pool of the memory guard's) and evicts least
recently used images first, never one the step at hand needs. The tower runs on at most
``ENCODE_BATCH`` pixel arrays at a time, so that its activations stay within the room the memory
guard sets aside for them.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import numpy as np

from mlxd.engined.vision.tower import VisionTower
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import ImageInput

# Pixel arrays (images or tiles) per tower call: a step's images are encoded together, this many at a time.
ENCODE_BATCH = 8


def row_runs(image: ImageInput) -> list[tuple[int, int]]:
    """(prompt position, length) of each run of ``image``'s positions that takes rows, in row order."""
    return [(image.offset + s, n) for s, n in image.runs] if image.runs else [(image.offset, image.length)]


def pixel_arrays(image: ImageInput) -> np.ndarray:
    """``image``'s pixels as [N, C, H, W]: one array, or its tiles."""
    pixels = np.frombuffer(image.pixels, dtype=np.float32).reshape(image.shape)
    return pixels[None] if pixels.ndim == 3 else pixels


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
                if image.offset >= start + n or image.offset + image.length <= start:
                    continue
                row = 0
                for at, length in row_runs(image):
                    lo, hi = max(start, at), min(start + n, at + length)
                    if lo < hi:
                        spans.append((image, row + lo - at, row + hi - at, offset + lo - start))
                    row += length
            offset += n
        if not spans:
            return None
        features = self._features([s[0] for s in spans])
        rows = mx.concatenate([features[image.mm_hash][a:b] for image, a, b, _ in spans])
        positions = np.concatenate([np.arange(at, at + b - a) for _, a, b, at in spans]).astype(np.int32)
        return mx.array(positions), rows

    def _features(self, images: list[ImageInput]) -> dict[str, mx.array]:
        """Each image's ``[rows, hidden]`` rows, from the cache or encoded now (the missing images'
        pixel arrays in one tower call per array shape)."""
        found = {}
        arrays: dict[str, np.ndarray] = {}
        for image in images:
            if image.mm_hash in self._cache:
                self._cache.move_to_end(image.mm_hash)
                found[image.mm_hash] = self._cache[image.mm_hash]
            elif image.mm_hash not in found:
                arrays[image.mm_hash] = pixel_arrays(image)
        by_shape: dict[tuple, list[tuple[str, int]]] = {}  # array shape -> (image, its array's index)
        for h, pixels in arrays.items():
            by_shape.setdefault(pixels.shape[1:], []).extend((h, k) for k in range(len(pixels)))
        parts = {h: [None] * len(pixels) for h, pixels in arrays.items()}
        for group in by_shape.values():
            for at in range(0, len(group), ENCODE_BATCH):
                batch = group[at : at + ENCODE_BATCH]
                out = self.tower.encode(mx.array(np.stack([arrays[h][k] for h, k in batch])))
                mx.eval(out)  # before the next batch: only one batch's activations at a time
                for j, (h, k) in enumerate(batch):
                    parts[h][k] = out[j]
        # Each image's rows in an array of its own, so that evicting one frees its memory.
        encoded = {h: mx.contiguous(mx.concatenate(p) if len(p) > 1 else p[0]) for h, p in parts.items()}
        mx.eval(list(encoded.values()))
        found.update(encoded)
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
    """Raise InvalidRequestError unless every image lies inside the prompt, in order, on a model with a
    tower, and its runs take as many rows as its pixels make."""
    if embeds is None:
        raise InvalidRequestError(f"the model `{model}` does not take images")
    end = 0
    for image in images:
        if image.offset < end or image.length <= 0 or image.offset + image.length > num_prompt_tokens:
            raise InvalidRequestError("an image's placeholder tokens lie outside the prompt or overlap another's")
        if len(image.shape) not in (3, 4) or int(np.prod(image.shape)) * 4 != len(image.pixels):
            raise InvalidRequestError("an image's pixels do not fill its shape")
        at = 0
        for run in image.runs or [[0, image.length]]:
            if len(run) != 2 or run[0] < at or run[1] <= 0:
                raise InvalidRequestError("an image's runs are not ordered, non-empty [start, length] pairs")
            at = run[0] + run[1]
        if at > image.length:
            raise InvalidRequestError("an image's runs end past its span")
        if not embeds.tower.fits(image.shape):
            raise InvalidRequestError(f"an image's pixel array {list(image.shape[-3:])} is larger than "
                                      f"{embeds.tower.largest}, the largest this model's memory budget holds "
                                      "room to encode: send a smaller image")
        rows = sum(n for _, n in image.runs) if image.runs else image.length
        if embeds.tower.num_tokens(image.shape) != rows:
            raise InvalidRequestError(f"an image of this model fills {embeds.tower.num_tokens(image.shape)} "
                                      f"placeholder tokens, not {rows}")
        end = image.offset + image.length
