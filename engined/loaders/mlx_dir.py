"""Local mlx_lm / Hugging Face model directories and cached Hugging Face repos."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlxd.engined.model_layers import check_model_type
from mlxd.shared.errors import ModelLoadError
from mlxd.shared.hub import cached_snapshot


@dataclass
class MTPWeights:
    """A checkpoint's multi-token-prediction tensors (``mtp.*``, that prefix cut), as stored and not
    yet read (MLX loads lazily), and whether the family's loader shifted the model's norms by one
    (Hugging Face's zero-centred norms of Qwen3-Next / Qwen3.5): the MTP layer's norms need the same."""

    tensors: dict[str, mx.array]
    shifted_norms: bool


@dataclass
class DirModel:
    model: nn.Module
    config: dict
    eos_token_ids: list[int]
    bos_token_id: int | None
    mtp: MTPWeights | None = None


def _mtp_name(key: str, config: dict) -> str | None:
    """The name, within the MTP layer's tensors, of checkpoint tensor ``key``; None if not one of them.

    Qwen3-Next / Qwen3.5 store the layer under ``mtp.``; GLM-4.5 (DeepSeek-V3's layout) as the
    model's layer ``num_hidden_layers``, one past its last.
    """
    if config.get("model_type") == "glm4_moe":
        prefix = f"model.layers.{config['num_hidden_layers']}."
        return key[len(prefix):] if key.startswith(prefix) else None
    if key.startswith("mtp.") or ".mtp." in key:
        return key.split("mtp.", 1)[1]
    return None


def model_classes(config: dict):
    """(model class, args class) of ``config``: mlx_lm's, or mlxd's for a vision checkpoint whose text
    model mlx_lm runs under another family's name (Idefics3: a Llama in Mistral 3's wrapper)."""
    if config.get("model_type") == "idefics3":
        from mlxd.engined.loaders import idefics3_text

        return idefics3_text.Model, idefics3_text.ModelArgs
    return _get_classes(config)


def _keeping_mtp(found: list[MTPWeights]):
    """mlx_lm's class lookup, with each family's ``sanitize`` first setting the MTP layer's tensors
    aside into ``found`` (the engine's MTP speculation builds its layer from them; the families
    drop them, but Qwen3-Next keeps them in a checkpoint whose experts are already stacked, which
    the strict load would refuse)."""

    def classes(config: dict):
        model_class, args_class = model_classes(config)
        if not hasattr(model_class, "sanitize"):
            return model_class, args_class

        def sanitize(self, weights):
            names = {k: _mtp_name(k, config) for k in weights}
            mtp = {names[k]: v for k, v in weights.items() if names[k] is not None}
            if not mtp:
                return model_class.sanitize(self, weights)
            rest = {k: v for k, v in weights.items() if names[k] is None}
            out = model_class.sanitize(self, rest)
            norm = next((k for k in out if k.endswith("model.norm.weight")), None)
            # A norm the family shifted is a new array; one it kept is the stored one.
            found.append(MTPWeights(mtp, norm is not None and all(out[norm] is not v for v in rest.values())))
            return out

        wrapped = type(model_class.__name__, (model_class,), {"sanitize": sanitize})
        wrapped.__module__ = model_class.__module__
        return wrapped, args_class

    return classes


def gemma4_text_fields(text: dict) -> dict:
    """A Gemma 4 text config with mlx_lm's ``global_head_dim`` / ``num_global_key_value_heads``.

    transformers 5 writes the full-attention layers' head size and K/V heads per layer
    (``per_layer_config``) and drops the two fields, whose mlx_lm defaults (512, the sliding
    layers' heads) then mis-shape the model; the per-layer values fill them in.
    """
    per_layer = {int(i): c for i, c in (text.get("per_layer_config") or {}).items()}
    full = [per_layer.get(i, {}) for i, kind in enumerate(text.get("layer_types") or []) if kind == "full_attention"]
    if not full:
        return text
    text = dict(text)
    for field, key in (("global_head_dim", "head_dim"), ("num_global_key_value_heads", "num_key_value_heads")):
        if not text.get(field) and full[0].get(key):
            text[field] = full[0][key]
    return text


def rope_fields(config: dict) -> dict:
    """The RoPE fields of a config's ``rope_parameters``, named as mlx_lm's model args read them.

    transformers 5 writes every RoPE field under ``rope_parameters`` and none at the top: one dict
    (``rope_type``, ``rope_theta``, ``partial_rotary_factor`` and the scaling's own fields), or one
    dict per layer type (``full_attention``, ``sliding_attention``: Gemma 3, OLMo 3). Most of
    mlx_lm's families read ``rope_theta``, ``rope_scaling`` (``type`` or ``rope_type`` and the
    scaling's fields) and ``partial_rotary_factor`` at the top, and the sliding layers' base as
    ``rope_local_base_freq`` (Gemma 3) or ``swa_rope_theta`` (MiMo); missing, each falls back to
    its family's default, a base of 10,000 for most, with no warning. Per layer type, the top
    fields are the full layers' base and scaling (which mlx_lm's families with sliding layers apply
    to the full ones alone) and the sliding layers' base. As in transformers, the values under
    ``rope_parameters`` win; a family's args ignore the fields they do not declare.
    """
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or not params:
        return {}
    if all(isinstance(v, dict) or v is None for v in params.values()):  # per layer type
        full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        fields = {"rope_theta": full["rope_theta"]} if "rope_theta" in full else {}
        if "rope_theta" in sliding:
            fields["rope_local_base_freq"] = fields["swa_rope_theta"] = sliding["rope_theta"]
    else:
        full = params
        fields = {k: full[k] for k in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings")
                  if k in full}
    kind = full.get("rope_type", full.get("type", "default"))
    if kind != "default":
        scaling = {k: v for k, v in full.items() if k not in ("rope_theta", "partial_rotary_factor")}
        fields["rope_scaling"] = {**scaling, "type": kind, "rope_type": kind}
    return fields


def _fixed(config: dict, gemma4: bool) -> dict:
    config = {**config, **rope_fields(config)}
    return gemma4_text_fields(config) if gemma4 else config


def _config_fixes(config: dict) -> dict:
    """What ``load_dir`` lays over a checkpoint's config.json before mlx_lm reads it: the fields
    transformers 5 writes elsewhere, of the model and of the text model a wrapper holds."""
    model_type = config.get("model_type")
    fixes = _fixed(config, model_type == "gemma4_text")
    if isinstance(config.get("text_config"), dict):
        fixes["text_config"] = _fixed(config["text_config"], model_type == "gemma4")
    return fixes


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _special_token_ids(path: Path) -> tuple[list[int], int | None]:
    """EOS ids and BOS id as the checkpoint's configs and tokenizer files state them."""
    config = _read_json(path / "config.json")
    text = config.get("text_config", {})
    gen = _read_json(path / "generation_config.json")
    eos: list[int] = []
    for v in (gen.get("eos_token_id"), config.get("eos_token_id"), text.get("eos_token_id")):
        eos += [i for i in _ids(v) if i not in eos]
    bos = gen.get("bos_token_id", config.get("bos_token_id", text.get("bos_token_id")))

    # Otherwise, the tokenizer's named eos token.
    tok_config = _read_json(path / "tokenizer_config.json")
    if (not eos or bos is None) and (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))

        def token_id(name):
            t = tok_config.get(name)
            t = t.get("content") if isinstance(t, dict) else t
            return tok.token_to_id(t) if t else None

        if not eos and (i := token_id("eos_token")) is not None:
            eos.append(i)
        if bos is None:
            bos = token_id("bos_token")
    return eos, None if bos is None else int(bos)


def load_dir(path: Path) -> DirModel:
    """Load an mlx_lm/HF safetensors directory through mlx_lm's own loader (weights evaluated).

    A ``model_type`` mlxd does not run is refused from config.json before any weight is read.
    """
    declared = _read_json(path / "config.json")
    check_model_type(declared)
    mtp: list[MTPWeights] = []
    try:
        model, config = mlx_lm_load_model(path, lazy=False, model_config=_config_fixes(declared),
                                          get_model_classes=_keeping_mtp(mtp))
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    except ValueError as e:  # mlx_lm's message for an unknown model_type or mismatched weights
        raise ModelLoadError(f"{path}: {e}") from e
    except (KeyError, TypeError) as e:  # a field the family's ModelArgs or layers need is missing or mistyped
        raise ModelLoadError(f"{path}: config.json does not describe an mlx_lm {declared['model_type']!r} model "
                             f"({type(e).__name__}: {e})") from e
    eos, bos = _special_token_ids(path)
    return DirModel(model=model, config=config, eos_token_ids=eos, bos_token_id=bos, mtp=mtp[0] if mtp else None)


def vision_checkpoint(config: dict) -> bool:
    """A vision-language checkpoint of a family whose tower mlxd runs (``engined.vision``); other
    families' vision checkpoints load as their text model."""
    from mlxd.engined.vision.tower import takes_images

    return takes_images(config)


def load_vision(path: Path, config: dict, model: nn.Module):
    """The checkpoint's vision tower and projector, in the text model's float dtype."""
    from mlxd.engined.model_layers import float_dtype
    from mlxd.engined.vision.tower import VisionTower

    return VisionTower(path, config, float_dtype(model))


def resolve_hf_repo(repo_id: str) -> Path:
    """A repo id's snapshot directory from the local Hugging Face cache; never downloads."""
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(cached_snapshot(repo_id))
    except HFValidationError as e:
        raise ModelLoadError(
            f"{repo_id!r} is neither a local path nor a valid Hugging Face repo id "
            "(expected a .gguf file, a model directory with config.json, or 'owner/name')",
            param="model",
        ) from e
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        raise ModelLoadError(
            f"model {repo_id!r}: it is not in the local Hugging Face cache (mlxd never downloads). "
            f"Download it first with `hf download {repo_id}` "
            "(or pass a local model directory or .gguf file).",
            param="model",
        ) from e


def dense_weights(model: nn.Module, dtype: mx.Dtype) -> None:
    """Dequantize every quantized layer and cast all float parameters to ``dtype`` (in place).

    Scales and biases are widened before dequantizing so that a float32
    target gets the exact values of the quantized weights (dequantizing in
    the scales' float16 would round them first).
    """
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import dequantize_model

    dense = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        affine = m.scales.dtype != mx.uint8  # mx/nv fp formats keep uint8 exponent scales
        biases = m.get("biases")
        weight = mx.dequantize(
            m.weight,
            m.scales.astype(mx.float32) if affine else m.scales,
            None if biases is None else biases.astype(mx.float32),
            m.group_size,
            m.bits,
            m.mode,
        ).astype(dtype)
        if isinstance(m, nn.QuantizedLinear):
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
            if "bias" in m:
                layer.bias = m.bias
        else:
            layer = nn.Embedding(weight.shape[0], weight.shape[1])
        layer.weight = weight
        dense.append((name, layer))
    if dense:
        model.update_modules(tree_unflatten(dense))
    dequantize_model(model)  # whatever else mlx_lm knows how to dequantize (MoE switch layers)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
