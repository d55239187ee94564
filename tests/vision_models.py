"""Tiny random-weight vision-language models for tests, built from mlx-vlm's own classes.

``make_tiny_gemma3_vlm(dir)`` writes a Gemma 3 checkpoint in Hugging Face's layout: the tiny
``gemma3`` text model of ``tests.tiny_models``, a SigLIP tower and Gemma 3's projector with the
shapes mlx-vlm's ``gemma3`` classes take (random weights, numpy-seeded), the processor's files
(transformers' ``Gemma3Processor``: a 64x64 image in 8x8 patches pooled to 16 soft tokens) and a
chat template that writes ``<start_of_image>`` for an image part.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.tiny_models import make_tiny_model, tiny_vocab, write_tokenizer

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
IMAGE_SIZE, PATCH, IMAGE_TOKENS = 64, 8, 16

GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _vision_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Weights of mlx-vlm's gemma3 vision tower and projector, under Hugging Face's names (the
    patch convolution as PyTorch stores it, [out, in, kh, kw])."""
    from mlx.utils import tree_flatten

    from mlxd.engined.vision.tower import vlm_config

    module, model_config = vlm_config(config, Path("."))
    model = module.Model(model_config)
    rng = np.random.default_rng(seed + 7)
    weights = {}
    for prefix in ("vision_tower", "multi_modal_projector"):
        for name, p in tree_flatten(getattr(model, prefix).parameters()):
            shape = p.shape
            if "patch_embedding.weight" in name:  # MLX's [out, kh, kw, in] stored as PyTorch's
                w = rng.standard_normal((shape[0], shape[3], shape[1], shape[2])) / np.sqrt(shape[1] * shape[2] * 3)
            elif "norm" in name and name.endswith("weight"):
                w = 1.0 + 0.2 * rng.standard_normal(shape)
            elif name.endswith("bias"):
                w = 0.1 * rng.standard_normal(shape)
            elif name == "mm_input_projection_weight":
                w = rng.standard_normal(shape)
            else:
                w = rng.standard_normal(shape) / np.sqrt(shape[-1])
            weights[f"{prefix}.{name}"] = w.astype(np.float32)
    return weights


def make_tiny_gemma3_vlm(directory, seed: int = 0) -> Path:
    """A tiny Gemma 3 vision-language checkpoint in ``directory``; its path."""
    import mlx.core as mx

    out = make_tiny_model(directory, "gemma3", seed=seed)
    config = json.loads((out / "config.json").read_text())
    tokens, merges, special = tiny_vocab(config["vocab_size"])
    first_free = tokens.index("<|reserved_0|>")
    tokens[first_free : first_free + 3] = [BOI, IMAGE, EOI]
    config.update({
        "image_token_index": first_free + 1, "boi_token_index": first_free, "eoi_token_index": first_free + 2,
        "mm_tokens_per_image": IMAGE_TOKENS, "pad_token_id": 0,
        "hidden_size": config["text_config"]["hidden_size"],
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": PATCH,
                          "image_size": IMAGE_SIZE, "layer_norm_eps": 1e-6},
    })
    config["text_config"]["mm_tokens_per_image"] = IMAGE_TOKENS
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(mx.load(str(out / "model.safetensors")))
    del weights["language_model.lm_head.weight"]  # Gemma 3's head is its embedding, as mlx_lm's class ties it
    weights.update({k: mx.array(v) for k, v in _vision_weights(config, seed).items()})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})

    write_tokenizer(out, tokens, merges, special, tokens[config["bos_token_id"]], tokens[config["eos_token_id"]],
                    config["max_position_embeddings"])
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.update({"chat_template": GEMMA3_TEMPLATE, "processor_class": "Gemma3Processor",
                       "extra_special_tokens": {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}})
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True, "do_pan_and_scan": False, "resample": 2,
    }, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                            "image_seq_length": IMAGE_TOKENS}, indent=2))
    return out


def random_image(seed: int, size: tuple[int, int] = (48, 40)):
    """A PIL RGB image of random pixels (another size than the model's, so that it is resized)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")
