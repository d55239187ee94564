"""Tiny random-weight vision-language models for tests, built from mlx-vlm's own classes.

``make_tiny_gemma3_vlm(dir)`` writes a Gemma 3 checkpoint in Hugging Face's layout: the tiny
``gemma3`` text model of ``tests.tiny_models``, a SigLIP tower and Gemma 3's projector with the
shapes mlx-vlm's ``gemma3`` classes take (random weights, numpy-seeded), the processor's files
(transformers' ``Gemma3Processor``: a 64x64 image in 8x8 patches pooled to 16 soft tokens) and a
chat template that writes ``<start_of_image>`` for an image part.

``make_tiny_idefics3_vlm(dir)`` writes an Idefics3 (SmolVLM) checkpoint the same way: a Llama
under ``model.text_model``, an Idefics3 tower and connector, and transformers'
``Idefics3Processor``, which cuts an image into up to 2x2 tiles of 32x32 and a global tile, each
4 tokens (8x8 patches, pixel-shuffled by 2) between its row/column markers.

``VLMS`` maps each family to its maker and its image token.

Over 400 lines because each family's checkpoint needs its tower, projector and processor files written
the way mlx-vlm and transformers read them, beside the shared text model and template.
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


def _vision_weights(config: dict, seed: int, prefixes=("vision_tower", "multi_modal_projector"),
                    stored_under: str = "") -> dict[str, np.ndarray]:
    """Weights of mlx-vlm's vision tower and projector of ``config``'s family, under Hugging Face's
    names (the patch convolution as PyTorch stores it, [out, in, kh, kw])."""
    from mlx.utils import tree_flatten

    from mlxd.engined.vision.tower import vlm_config

    module, model_config = vlm_config(config, Path("."))
    model = module.Model(model_config)
    rng = np.random.default_rng(seed + 7)
    weights = {}
    for prefix in prefixes:
        for name, p in tree_flatten(getattr(model, prefix).parameters()):
            shape = p.shape
            if name.endswith(("patch_embedding.weight", "patch_conv.weight")):  # MLX's [out, kh, kw, in] as PyTorch's
                w = rng.standard_normal((shape[0], shape[3], shape[1], shape[2])) / np.sqrt(shape[1] * shape[2] * 3)
            elif ("norm" in name or "ln_pre" in name) and name.endswith("weight"):
                w = 1.0 + 0.2 * rng.standard_normal(shape)
            elif name.endswith("bias"):
                w = 0.1 * rng.standard_normal(shape)
            elif name == "mm_input_projection_weight":
                w = rng.standard_normal(shape)
            else:
                w = rng.standard_normal(shape) / np.sqrt(shape[-1])
            weights[f"{stored_under}{prefix}.{name}"] = w.astype(np.float32)
    return weights


# What every tiny model's image processor does besides its own settings: resize, rescale to [0, 1],
# normalize to [-1, 1], convert to RGB.
_IMAGE_DEFAULTS = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}


def _write_processor(out: Path, config: dict, vocab: tuple, eos: str, template: str, processor: str,
                     preprocessor: dict, processor_config: dict | None = None, tokenizer_config: dict | None = None):
    """The tokenizer of ``vocab`` (tokens, merges, is_special) with the chat ``template``, and the files
    that name transformers' ``processor``: its image processor's ``preprocessor`` settings beside
    ``_IMAGE_DEFAULTS``, ``processor_config`` and ``tokenizer_config`` entries."""
    tokens, merges, special = vocab
    write_tokenizer(out, tokens, merges, special, tokens[config["bos_token_id"]], eos,
                    config["max_position_embeddings"])
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.update({"chat_template": template, "processor_class": processor, **(tokenizer_config or {})})
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"processor_class": processor, **_IMAGE_DEFAULTS, **preprocessor}, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor, **(processor_config or {})},
                                                          indent=2))


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

    _write_processor(out, config, (tokens, merges, special), tokens[config["eos_token_id"]], GEMMA3_TEMPLATE,
                     "Gemma3Processor", {"image_processor_type": "Gemma3ImageProcessor",
                                         "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                         "do_pan_and_scan": False, "resample": 2},
                     {"image_seq_length": IMAGE_TOKENS},
                     {"extra_special_tokens": {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}})
    return out


IDEFICS3_IMAGE, IDEFICS3_TILE = "<image>", 32
IDEFICS3_MARKERS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
IDEFICS3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def make_tiny_idefics3_vlm(directory, seed: int = 0) -> Path:
    """A tiny Idefics3 (SmolVLM) vision-language checkpoint in ``directory``; its path."""
    import mlx.core as mx

    vocab_size = 320
    out = make_tiny_model(directory, "idefics3", seed=seed, vocab_size=vocab_size)
    config = json.loads((out / "config.json").read_text())
    tokens, merges, special = tiny_vocab(vocab_size)
    first_free = tokens.index("<|reserved_0|>")
    added = [IDEFICS3_IMAGE] + IDEFICS3_MARKERS
    tokens[first_free : first_free + len(added)] = added
    config.update({
        "image_token_id": first_free, "scale_factor": 2,
        "vision_config": {"model_type": "idefics3_vision", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 8,
                          "image_size": IDEFICS3_TILE, "layer_norm_eps": 1e-6},
    })
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # Idefics3's names: the Llama under model.text_model, its head at the top.
    weights = {k.replace("language_model.model.", "model.text_model.").replace("language_model.lm_head", "lm_head"): v
               for k, v in mx.load(str(out / "model.safetensors")).items()}
    weights.update({k: mx.array(v) for k, v in _vision_weights(config, seed, ("vision_model", "connector"),
                                                               "model.").items()})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})

    _write_processor(out, config, (tokens, merges, special), "<end_of_utterance>", IDEFICS3_TEMPLATE,
                     "Idefics3Processor", {"image_processor_type": "Idefics3ImageProcessor", "do_image_splitting": True,
                                           "max_image_size": {"longest_edge": IDEFICS3_TILE},
                                           "size": {"longest_edge": 2 * IDEFICS3_TILE}, "do_pad": True, "resample": 1},
                     {"image_seq_len": 4})
    return out


PIXTRAL_IMAGE, PIXTRAL_MARKERS = "[IMG]", ["[IMG_BREAK]", "[IMG_END]"]
MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if message['role'] == 'user' %}[/INST]{% else %}{{ eos_token }}{% endif %}{% endfor %}"
)


def make_tiny_mistral3_vlm(directory, seed: int = 0) -> Path:
    """A tiny Mistral 3 vision-language checkpoint in ``directory``; its path: a Pixtral tower of 8x8
    patches, merged 2x2 by the projector (one token per 16x16 pixels, images up to 64 on the longest
    edge, any aspect), and the folder's Pixtral image processor (transformers' PixtralProcessor
    is named but needs torchvision)."""
    import mlx.core as mx

    out = make_tiny_model(directory, "mistral3", seed=seed)
    config = json.loads((out / "config.json").read_text())
    tokens, merges, special = tiny_vocab(config["vocab_size"])
    first_free = tokens.index("<|reserved_0|>")
    added = [PIXTRAL_IMAGE, *PIXTRAL_MARKERS, "[INST]", "[/INST]"]
    tokens[first_free : first_free + len(added)] = added
    config.update({
        "image_token_index": first_free, "spatial_merge_size": 2, "vision_feature_layer": -1,
        "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
        "vision_config": {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16, "patch_size": 8,
                          "image_size": IMAGE_SIZE, "rope_theta": 10000.0, "num_channels": 3},
    })
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(mx.load(str(out / "model.safetensors")))
    # Hugging Face's names: the tower without mlx-vlm's wrapper module.
    weights.update({k.replace("vision_tower.vision_model.", "vision_tower."): mx.array(v)
                    for k, v in _vision_weights(config, seed).items()})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})

    _write_processor(out, config, (tokens, merges, special), tokens[config["eos_token_id"]], MISTRAL3_TEMPLATE,
                     "PixtralProcessor", {"image_processor_type": "PixtralImageProcessor",
                                          "size": {"longest_edge": IMAGE_SIZE}, "patch_size": 8, "resample": 3},
                     {"patch_size": 8, "spatial_merge_size": 2, "image_token": PIXTRAL_IMAGE,
                      "image_break_token": PIXTRAL_MARKERS[0], "image_end_token": PIXTRAL_MARKERS[1]})
    return out


QWEN_IMAGE, QWEN_PATCH, QWEN_MERGE = "<|image_pad|>", 8, 2
QWEN_MARKERS = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen_vocab(config: dict) -> tuple:
    """The tiny vocabulary with Qwen-VL's image token and markers, their ids set in ``config``."""
    tokens, merges, special = tiny_vocab(config["vocab_size"])
    first_free = tokens.index("<|reserved_0|>")
    tokens[first_free : first_free + 4] = [QWEN_IMAGE] + QWEN_MARKERS
    config.update({"image_token_id": first_free, "vision_start_token_id": first_free + 1,
                   "vision_end_token_id": first_free + 2, "video_token_id": first_free + 3})
    return tokens, merges, special


def _qwen_tower(out_hidden: int) -> dict:
    """A tiny Qwen-VL tower's settings: 2 blocks of width 32, 8x8 patches merged 2x2 into rows of ``out_hidden``."""
    return {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": out_hidden, "num_heads": 2,
            "patch_size": QWEN_PATCH, "spatial_patch_size": QWEN_PATCH, "spatial_merge_size": QWEN_MERGE,
            "temporal_patch_size": 2, "in_channels": 3, "image_size": 48}


def _write_qwen_processor(out: Path, config: dict, vocab: tuple, processor: str) -> None:
    # Qwen2-VL's image processor (Qwen3.5's checkpoints use it too), resizing an image to at most 32x48.
    _write_processor(out, config, vocab, vocab[0][config["eos_token_id"]], QWEN_TEMPLATE, processor,
                     {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": QWEN_PATCH,
                      "merge_size": QWEN_MERGE, "temporal_patch_size": 2, "min_pixels": 16 * 16,
                      "max_pixels": 32 * 48, "resample": 3})


def make_tiny_qwen2_5_vl(directory, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL checkpoint in ``directory``; its path: the tiny ``qwen2_5_vl`` text model
    (head dim 16: M-RoPE sections of 2, 3 and 3 frequencies for time, height and width),
    mlx-vlm's Qwen2.5-VL tower and merger (8x8 patches, merged 2x2) stored as Hugging Face stores it
    (``visual.``), and Qwen2-VL's image processor resizing an image to at most 32x48."""
    import mlx.core as mx

    out = make_tiny_model(directory, "qwen2_5_vl", seed=seed)
    config = json.loads((out / "config.json").read_text())
    vocab = _qwen_vocab(config)
    config["vision_config"] = {"model_type": "qwen2_5_vl", **_qwen_tower(config["hidden_size"]), "window_size": 32,
                               "fullatt_block_indexes": [1]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(mx.load(str(out / "model.safetensors")))
    # Hugging Face's names: the tower as ``visual``.
    weights.update({k.replace("vision_tower.", "visual.", 1): mx.array(v)
                    for k, v in _vision_weights(config, seed, ("vision_tower",)).items()})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})

    _write_qwen_processor(out, config, vocab, "Qwen2_5_VLProcessor")
    return out


QWEN3_5_SECTIONS = [2, 1, 1]


def make_tiny_qwen3_5_vl(directory, seed: int = 0, moe: bool = False) -> Path:
    """A tiny Qwen3.5 checkpoint in ``directory``; its path: the tiny hybrid ``qwen3_5_vl`` text model
    (head dim 16, half of it rotated: M-RoPE sections of 2, 1 and 1 frequencies, interleaved; base 10),
    mlx-vlm's Qwen3.5 tower (Qwen3-VL's: 8x8 patches merged 2x2, a 4x4 table of learned positions)
    stored as transformers 5 stores it (``model.visual.``), and Qwen2-VL's image processor resizing
    an image to at most 32x48, named by Qwen3-VL's processor as Qwen3.5's checkpoints name it.
    ``moe``: Qwen3.5 MoE's (the ``qwen3_5_moe_vl`` text model, the same tower)."""
    import mlx.core as mx

    out = make_tiny_model(directory, "qwen3_5_moe_vl" if moe else "qwen3_5_vl", seed=seed)
    config = json.loads((out / "config.json").read_text())
    vocab = _qwen_vocab(config)
    text = config["text_config"]
    # A low RoPE base, so that every rotated frequency turns enough for the axes' layout to decide answers.
    text["rope_parameters"].update(mrope_section=QWEN3_5_SECTIONS, rope_theta=10.0)
    config["vision_config"] = {"model_type": config["model_type"], **_qwen_tower(text["hidden_size"]),
                               "num_position_embeddings": 16, "deepstack_visual_indexes": []}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(mx.load(str(out / "model.safetensors")))
    tower = _vision_weights(config, seed, ("vision_tower",))
    # PyTorch's Conv3d layout [out, in, t, h, w] for the patch embedding, as the checkpoints store it.
    conv = "vision_tower.patch_embed.proj.weight"
    tower[conv] = tower[conv].transpose(0, 4, 1, 2, 3)
    weights.update({k.replace("vision_tower.", "model.visual.", 1): mx.array(v) for k, v in tower.items()})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})

    _write_qwen_processor(out, config, vocab, "Qwen3VLProcessor")
    return out


def make_tiny_qwen3_5_moe_vl(directory, seed: int = 0) -> Path:
    """A tiny Qwen3.5 MoE checkpoint in ``directory`` (``make_tiny_qwen3_5_vl``'s, its text model MoE)."""
    return make_tiny_qwen3_5_vl(directory, seed, moe=True)


GEMMA4_BOI, GEMMA4_IMAGE, GEMMA4_EOI = "<|image>", "<|image|>", "<image|>"
GEMMA4_TEMPLATE = GEMMA3_TEMPLATE.replace("<start_of_image>", GEMMA4_IMAGE)


def make_tiny_gemma4_vlm(directory, seed: int = 0) -> Path:
    """A tiny Gemma 4 vision-language checkpoint in ``directory``; its path: the tiny ``gemma4`` text
    model (per-layer inputs), Gemma 4's tower of 4x4 patches pooled 3x3 (at most 70 rows an image,
    of its own aspect) and embedder under Hugging Face's names (``model.``), and transformers' Gemma 4
    image processor (its processor is named but needs torchvision) as transformers 5 saves it."""
    import mlx.core as mx

    out = make_tiny_model(directory, "gemma4", seed=seed)
    config = json.loads((out / "config.json").read_text())
    tokens, merges, special = tiny_vocab(config["vocab_size"])
    first_free = tokens.index("<|reserved_0|>")
    tokens[first_free : first_free + 4] = [GEMMA4_BOI, GEMMA4_IMAGE, GEMMA4_EOI, "<|audio|>"]
    config.update({
        "boi_token_id": first_free, "image_token_id": first_free + 1, "eoi_token_id": first_free + 2,
        "audio_token_id": first_free + 3, "vision_soft_tokens_per_image": 70,
        # RoPE stated as Gemma 4's config.json states it (mlx_lm and mlx-vlm default the global layers'
        # rotated share differently).
        "text_config": {**config["text_config"], "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"}}},
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                          "head_dim": 16, "global_head_dim": 16, "patch_size": 4, "pooling_kernel_size": 3,
                          "default_output_length": 70, "position_embedding_size": 64},
    })
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(mx.load(str(out / "model.safetensors")))
    weights.update({k: mx.array(v) for k, v in _vision_weights(config, seed, ("vision_tower", "embed_vision"),
                                                               "model.").items()})
    # Clipping bounds a checkpoint may carry while its config leaves them unused (use_clipped_linears).
    for bound in ("input_min", "input_max", "output_min", "output_max"):
        weights[f"model.vision_tower.encoder.layers.0.self_attn.q_proj.{bound}"] = mx.array(1.0)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    # Gemma 4's image processor (pixels in [0, 1]: the tower rescales them) as transformers 5 saves it,
    # nested in processor_config.json, with no preprocessor_config.json.
    image = {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 4, "max_soft_tokens": 70,
             "pooling_kernel_size": 3, "resample": 3, "do_normalize": False}
    _write_processor(out, config, (tokens, merges, special), tokens[config["eos_token_id"]], GEMMA4_TEMPLATE,
                     "Gemma4Processor", image, {"image_seq_length": 70, "image_processor": {**_IMAGE_DEFAULTS, **image}},
                     {"extra_special_tokens": {"boi_token": GEMMA4_BOI, "image_token": GEMMA4_IMAGE,
                                               "eoi_token": GEMMA4_EOI}})
    (out / "preprocessor_config.json").unlink()
    return out


VLMS = {"gemma3": (make_tiny_gemma3_vlm, IMAGE), "idefics3": (make_tiny_idefics3_vlm, IDEFICS3_IMAGE),
        "mistral3": (make_tiny_mistral3_vlm, PIXTRAL_IMAGE), "qwen2_5_vl": (make_tiny_qwen2_5_vl, QWEN_IMAGE),
        "gemma4": (make_tiny_gemma4_vlm, GEMMA4_IMAGE), "qwen3_5": (make_tiny_qwen3_5_vl, QWEN_IMAGE),
        "qwen3_5_moe": (make_tiny_qwen3_5_moe_vl, QWEN_IMAGE)}


def quantize_tower(path: Path, group_size: int = 32, bits: int = 8) -> None:
    """Quantize the vision tower's and projector's matrices of the checkpoint at ``path`` in place, as
    mlx-vlm's conversions may (their scales and biases beside them, ``quantization`` in config.json)."""
    import mlx.core as mx

    weights = dict(mx.load(str(path / "model.safetensors")))
    text = ("language_model", "text_model", "lm_head")
    for name in [k for k, v in weights.items() if k.endswith(".weight") and v.ndim == 2
                 and v.shape[-1] % group_size == 0 and not any(t in k for t in text)]:
        stem = name[: -len("weight")]
        weights[name], weights[stem + "scales"], weights[stem + "biases"] = mx.quantize(weights[name], group_size, bits)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": group_size, "bits": bits}
    (path / "config.json").write_text(json.dumps(config, indent=2))


def processor_of(path: Path):
    """transformers' own processor of the model at ``path``, as the gateway loads it (named, because
    mlx-vlm, once its family module is imported, answers AutoProcessor with a processor of its own),
    or the gateway's own expansion where it writes the family's placeholders."""
    import transformers

    from mlxd.gateway.media_processor import processor_class
    from mlxd.gateway.placeholders import EXPANSIONS, PlaceholderExpansion

    name = processor_class(Path(path))
    if name in EXPANSIONS:
        return PlaceholderExpansion.load(str(path), EXPANSIONS[name])
    return getattr(transformers, name).from_pretrained(path)


def reference_processor(processor):
    """The processor whose token ids and pixels mlx-vlm's generation takes: ``processor``, or for
    Pixtral's placeholders, which the gateway writes, mlx-vlm's own processor of the same folder (so
    that the gateway's expansion is checked against another's)."""
    from mlx_vlm.utils import load_processor

    from mlxd.gateway.placeholders import EXPANSIONS, PlaceholderExpansion

    if isinstance(processor, PlaceholderExpansion) and processor.expansion in (EXPANSIONS["PixtralProcessor"],
                                                                             EXPANSIONS["Gemma4Processor"]):
        return load_processor(Path(processor.tokenizer.name_or_path))
    return processor


def random_image(seed: int, size: tuple[int, int] = (48, 40)):
    """A PIL RGB image of random pixels (another size than the model's, so that it is resized)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")
