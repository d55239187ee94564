"""A checkpoint's vision tower and projector, built from mlx-vlm's classes: pixels in, rows of the
text model's input embeddings out.

mlx-vlm's family module gives the config classes, the tower and the projector; only those two
modules are built (the text model is mlx_lm's, which the engine already runs) and only their
tensors are read from the checkpoint. What a family does between the projector and the text
model's embeddings (Gemma 3 divides by the square root of the hidden size, which its text model
multiplies back) is the family's entry in ``FAMILIES``, written from mlx-vlm's own merge so that
the rows equal the ones mlx-vlm's model feeds its language model.
"""

from __future__ import annotations

import glob
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.shared.errors import ModelLoadError


def _gemma3_features(tower: nn.Module, projector: nn.Module, config, pixels: mx.array) -> mx.array:
    # mlx-vlm's Gemma 3: the tower takes NHWC, its last hidden state is pooled and projected, and the
    # merge scales the features down by sqrt(hidden) because the text model scales every row up by it.
    hidden, _, _ = tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
    return projector(hidden) / (config.hidden_size ** 0.5)


def _gemma3_tokens(config, shape: list[int]) -> int:
    return config.text_config.mm_tokens_per_image


def _idefics3_features(tower: nn.Module, projector: nn.Module, config, pixels: mx.array) -> mx.array:
    # mlx-vlm's Idefics3: each tile through the tower (every patch real: the processor's tiles are
    # full squares), then the connector's pixel shuffle and projection; no scaling at the merge.
    hidden, _, _ = tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
    return projector(hidden.astype(pixels.dtype))


def _idefics3_tokens(config, shape: list[int]) -> int:
    patch = config.vision_config.patch_size
    return (shape[1] // patch) * (shape[2] // patch) // config.scale_factor ** 2


def _qwen_vl_features(tower: nn.Module, projector: nn.Module, config, pixels: mx.array) -> mx.array:
    # mlx-vlm's Qwen2.5-VL and Qwen3.5: the tower (its merger inside) takes every image's patches in one sequence
    # with each image's grid; an image is one temporal patch, its pixels [h, w, patch values].
    n, h, w, values = pixels.shape
    rows = tower(pixels.reshape(-1, values), mx.array([[1, h, w]] * n), output_hidden_states=False)
    if isinstance(rows, tuple):  # Qwen3-VL's tower (Qwen3.5's) also returns deepstack features, none for 3.5
        rows = rows[0]
    return rows.reshape(n, -1, rows.shape[-1])


def _qwen_vl_tokens(config, shape: list[int]) -> int:
    # 0 (refused at admission) for a grid the merger cannot fold or patches of another size.
    v = config.vision_config
    merge = v.spatial_merge_size
    if shape[0] % merge or shape[1] % merge or shape[2] != v.in_channels * v.temporal_patch_size * v.patch_size ** 2:
        return 0
    return shape[0] * shape[1] // merge ** 2


def _qwen_vl_names(name: str) -> str:
    # Hugging Face stores Qwen2.5-VL's and Qwen3.5's tower as ``visual`` (``model.visual`` from transformers 5 on);
    # mlx-vlm's conversions, as its module, ``vision_tower``.
    for stored in ("model.visual.", "visual."):
        if name.startswith(stored):
            return "vision_tower." + name[len(stored):]
    return name


# Qwen's documented bound for its dynamic resolution (max_pixels 1280 * 28 * 28 for Qwen2.5-VL): its
# processors otherwise keep up to 12.8M pixels, an array whose encoding would not fit beside the KV pool.
QWEN_MAX_IMAGE_TOKENS = 1280


def _qwen_vl_max_pixels(config, processor: dict) -> int:
    # The most pixels an image keeps after the processor's resize: 1280 image tokens' worth, fewer
    # where the checkpoint's processor states fewer (max_pixels, or transformers 5's size.longest_edge).
    v = config.vision_config
    stated = processor.get("max_pixels") or (processor.get("size") or {}).get("longest_edge")
    bound = QWEN_MAX_IMAGE_TOKENS * (v.patch_size * v.spatial_merge_size) ** 2
    return min(bound, int(stated)) if stated else bound


def _qwen_vl_image(config, max_pixels: int) -> list[int]:
    # The grid of merged patches nearest a square that holds the most the bound allows (the
    # processor's resize keeps whole merged patches within max_pixels).
    v = config.vision_config
    merged = max(max_pixels // (v.patch_size * v.spatial_merge_size) ** 2, 1)
    rows = next(r for r in range(math.isqrt(merged), 0, -1) if merged % r == 0)
    m = v.spatial_merge_size
    return [rows * m, merged // rows * m, v.in_channels * v.temporal_patch_size * v.patch_size ** 2]


def _pixtral_features(tower: nn.Module, projector: nn.Module, config, pixels: mx.array) -> mx.array:
    # mlx-vlm's Mistral 3: the chosen layer's states through the projector, whose merger folds 2x2
    # patches into one row; no scaling at the merge. One image at a time, each evaluated before the
    # next: the tower attends over its whole input as one sequence (a block mask keeps images apart),
    # so a batch's mask would grow with the square of its patches, past the memory guard's room.
    size = [tuple(pixels.shape[2:])]
    rows = []
    for image in pixels:
        _, states = tower(image[None].transpose(0, 2, 3, 1), output_hidden_states=True, image_sizes=size)
        rows.append(projector(states[config.vision_feature_layer][0], size))
        mx.eval(rows[-1])
    return mx.stack(rows)


def _pixtral_tokens(config, shape: list[int]) -> int:
    # 0 (refused at admission) for sides the merger cannot fold or past the largest the processor makes.
    v = config.vision_config
    side = v.patch_size * config.spatial_merge_size
    if shape[0] != v.num_channels or shape[1] % side or shape[2] % side or max(shape[1:]) > v.image_size:
        return 0
    return (shape[1] // side) * (shape[2] // side)


def _model_prefix_dropped(name: str) -> str:
    # transformers 5 stores a vision checkpoint's towers under ``model.``; mlx-vlm's conversions do not.
    return name[len("model."):] if name.startswith("model.") else name


def _pixtral_names(name: str) -> str:
    # Hugging Face stores Pixtral's tower without the wrapper module mlx-vlm puts around it.
    name = _model_prefix_dropped(name)
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name[len("vision_tower."):]
    return name


def _gemma4_features(tower: nn.Module, projector: nn.Module, config, pixels: mx.array) -> mx.array:
    # mlx-vlm's Gemma 4: each image's patches [h, w, values] with their x, y positions through the
    # tower, which pools k x k patches into a row, then the embedder; scaled down by sqrt(hidden) as
    # Gemma 3's, since the text model scales every row up by it.
    n, h, w, values = pixels.shape
    x, y = np.meshgrid(np.arange(w), np.arange(h), indexing="xy")
    positions = mx.array(np.broadcast_to(np.stack([x, y], -1).reshape(1, h * w, 2), (n, h * w, 2)))
    rows = projector(tower(pixels.reshape(n, h * w, values), positions))
    return rows.reshape(n, -1, rows.shape[-1]) / (config.text_config.hidden_size ** 0.5)


def _gemma4_tokens(config, shape: list[int]) -> int:
    # 0 (refused at admission) for a grid the pooling cannot fold, patches of another size, or more
    # patches than the processor makes.
    v = config.vision_config
    k = v.pooling_kernel_size
    if shape[0] % k or shape[1] % k or shape[2] != 3 * v.patch_size ** 2 or \
            shape[0] * shape[1] > v.default_output_length * k * k:
        return 0
    return shape[0] * shape[1] // (k * k)


def _gemma4_image(config, _max_pixels=None) -> list[int]:
    v = config.vision_config  # the most patches an image makes, as one row of pooling windows
    return [v.pooling_kernel_size, v.pooling_kernel_size * v.default_output_length, 3 * v.patch_size ** 2]


def _square_image(config, _max_pixels=None) -> list[int]:
    v = config.vision_config
    return [v.num_channels, v.image_size, v.image_size]


@dataclass(frozen=True)
class Family:
    features: Callable  # (tower, projector, mlx-vlm config, pixels [N, C, H, W]) -> [N, tokens, hidden]
    num_tokens: Callable  # (mlx-vlm config, one pixel array's shape [C, H, W]) -> its rows
    # (mlx-vlm config, max_pixels) -> the shape of the largest pixel array the processor makes
    largest_image: Callable
    tower: str = "vision_tower"  # the modules' names in mlx-vlm's Model, and the checkpoint's prefixes
    projector: str = "multi_modal_projector"  # "": the tower projects its own rows
    stored_under: str = ""  # what the checkpoint's names carry before those prefixes
    renamed: Callable | None = None  # a checkpoint's name -> mlx-vlm's, where they differ
    model_sanitize: bool = False  # the tower's weights also through mlx-vlm's Model.sanitize (its renames and drops)
    mrope: str = ""  # the text model's multi-axis RoPE layout (engined.vision.mrope.LAYOUTS); "": one position
    # (mlx-vlm config, the folder's image processor settings) -> the most pixels an image may keep after
    # the gateway's processor resizes it; None: the processor's own sizes already bound it (fixed size, tiles).
    max_pixels: Callable | None = None


# Qwen3.5 and Qwen3.5 MoE: Qwen3-VL's tower (deepstack off), its M-RoPE frequencies interleaved over the axes.
_QWEN3_5 = Family(_qwen_vl_features, _qwen_vl_tokens, _qwen_vl_image, projector="", renamed=_qwen_vl_names,
                  mrope="interleaved", max_pixels=_qwen_vl_max_pixels)

FAMILIES = {
    "gemma3": Family(_gemma3_features, _gemma3_tokens, _square_image),
    "idefics3": Family(_idefics3_features, _idefics3_tokens, _square_image, tower="vision_model",
                       projector="connector", stored_under="model."),
    "mistral3": Family(_pixtral_features, _pixtral_tokens, _square_image, renamed=_pixtral_names),
    "qwen2_5_vl": Family(_qwen_vl_features, _qwen_vl_tokens, _qwen_vl_image, projector="", renamed=_qwen_vl_names,
                         mrope="sectioned", max_pixels=_qwen_vl_max_pixels),
    "qwen3_5": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5,
    # Gemma 4's checkpoints may carry clipping bounds its config leaves unused; mlx-vlm's sanitize drops them.
    "gemma4": Family(_gemma4_features, _gemma4_tokens, _gemma4_image, projector="embed_vision",
                     renamed=_model_prefix_dropped, model_sanitize=True),
}


def takes_images(config: dict) -> bool:
    """A vision-language checkpoint of a family whose tower mlxd runs, whose image tokens attend
    causally as mlxd's attention does (Gemma 4's larger checkpoints let an image's tokens see each
    other both ways: ``use_bidirectional_attention``)."""
    causal = (config.get("text_config") or {}).get("use_bidirectional_attention") is None
    return isinstance(config.get("vision_config"), dict) and config.get("model_type") in FAMILIES and causal


def image_processor_settings(path: Path) -> dict:
    """The folder's image processor settings: preprocessor_config.json, or the image processor
    transformers 5 nests in processor_config.json; {} without either."""
    for name, nested in (("preprocessor_config.json", False), ("processor_config.json", True)):
        if (path / name).is_file():
            settings = json.loads((path / name).read_text())
            settings = settings.get("image_processor") if nested else settings
            if isinstance(settings, dict):
                return settings
    return {}


def vlm_config(config: dict, path: Path):
    """(mlx-vlm's family module, its ModelConfig with the sub-configs built) for ``config``."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    module, _ = get_model_and_args(config=config, model_path=path)
    model_config = module.ModelConfig.from_dict(config)
    return module, update_module_configs(model_config, module, config, ["text", "vision", "projector"])


class VisionTower:
    """The tower and projector of one checkpoint; ``encode`` runs a batch of images through both."""

    def __init__(self, path: Path, config: dict, dtype: mx.Dtype):
        family = FAMILIES.get(config.get("model_type"))
        if family is None:
            raise ModelLoadError(f"{path}: images are not supported for model_type {config.get('model_type')!r} "
                                 f"(vision families: {', '.join(sorted(FAMILIES))})")
        self.family = family
        module, self.config = vlm_config(dict(config), path)
        # mlx-vlm's Model builds the text model too; its tower and projector are taken and the rest dropped.
        whole = module.Model(self.config)
        self.tower = getattr(whole, family.tower)
        self.projector = getattr(whole, family.projector) if family.projector else nn.Module()
        sanitize = whole.sanitize if family.model_sanitize else None
        del whole
        prefixes = (family.tower + ".", family.projector + ".")
        stored = tuple(family.stored_under + p for p in prefixes)
        weights = {}
        renamed = family.renamed or (lambda name: name)
        for file in sorted(glob.glob(str(path / "*.safetensors"))):
            named = ((renamed(k), v) for k, v in mx.load(file).items())
            weights.update({k[len(family.stored_under):]: v for k, v in named if k.startswith(stored)})
        if sanitize is not None:
            weights = sanitize(weights)
        if hasattr(self.tower, "sanitize"):  # PyTorch's conv layout to MLX's
            weights = self.tower.sanitize(weights)
        quantization = config.get("quantization")
        if quantization:  # mlx-vlm's conversions may quantize the tower's linear layers too: those with scales
            for module, prefix in zip((self.tower, self.projector), prefixes):
                nn.quantize(module, quantization["group_size"], quantization["bits"],
                            mode=quantization.get("mode", "affine"),
                            class_predicate=lambda path, _, prefix=prefix: f"{prefix}{path}.scales" in weights)
        tower_w = [(k[len(prefixes[0]):], v) for k, v in weights.items() if k.startswith(prefixes[0])]
        proj_w = [(k[len(prefixes[1]):], v) for k, v in weights.items() if k.startswith(prefixes[1])]
        try:
            self.tower.load_weights(tower_w)
            self.projector.load_weights(proj_w)
        except ValueError as e:
            raise ModelLoadError(f"{path}: the vision tower's weights do not fit mlx-vlm's "
                                 f"{config['model_type']} classes ({e})") from e
        self.tower.set_dtype(dtype)
        self.projector.set_dtype(dtype)
        self.tower.eval()
        self.projector.eval()
        mx.eval(self.tower.parameters(), self.projector.parameters())
        self.dtype = dtype
        self.max_pixels = family.max_pixels(self.config, image_processor_settings(path)) if family.max_pixels else None
        self.largest = self.family.largest_image(self.config, self.max_pixels)
        self.activation_bytes = self._measure()

    def _measure(self) -> int:
        """Bytes that encoding one of the largest images allocates beyond what is already held, measured
        once here: the memory guard sets aside room for the tower's batches beside the KV pool."""
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(self.encode(mx.zeros([1, *self.largest])))
        used = max(mx.get_peak_memory() - held, 0)
        mx.clear_cache()
        return used

    @property
    def nbytes(self) -> int:
        """The tower's and projector's weights, for the memory guard."""
        from mlx.utils import tree_flatten

        return sum(v.nbytes for m in (self.tower, self.projector) for _, v in tree_flatten(m.parameters()))

    def fits(self, shape: list[int]) -> bool:
        """Whether each pixel array of ``shape`` is no larger than the one the memory guard measured: a
        larger one would encode past the room set aside for the tower."""
        return math.prod(shape[-3:]) <= math.prod(self.largest)

    def num_tokens(self, shape: list[int]) -> int:
        """The rows an image of pixel ``shape`` [C, H, W], or of N tiles [N, C, H, W], encodes to."""
        tiles = shape[0] if len(shape) == 4 else 1
        return tiles * self.family.num_tokens(self.config, list(shape[-3:]))

    def encode(self, pixels: mx.array) -> mx.array:
        """``pixels [N, C, H, W]`` (one shape for the batch) to ``[N, tokens, hidden]`` input rows."""
        return self.family.features(self.tower, self.projector, self.config, pixels.astype(self.dtype))
