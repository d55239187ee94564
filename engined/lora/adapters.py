"""LoRA adapter directories read into one form: per module, ``a`` and ``b`` with the scale folded into ``b``.

Two formats:

- mlx_lm (``mlx_lm.lora`` writes them): ``adapters.safetensors`` with
  ``<module>.lora_a`` ``[in, r]`` and ``<module>.lora_b`` ``[r, out]`` (a
  switch layer's ``[E, r, in]`` and ``[E, out, r]``), module paths from the
  model's root; ``adapter_config.json`` gives ``lora_parameters.scale``.
- PEFT: ``adapter_model.safetensors`` with
  ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
  ``[out, r]``; the scale is ``lora_alpha / r`` (``/ sqrt(r)`` with
  ``use_rslora``). Hugging Face MoE experts (``mlp.experts.<e>.<proj>``) are
  stacked into the switch layer mlx_lm builds from them.

A module's weights come out as float32 numpy arrays: ``a`` ``[in, r]`` and
``b`` ``[r, out]``, or for a switch layer ``[E, in, r]`` and ``[E, r, out]``.
Nothing here knows the model; ``registry`` checks the modules against it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxd.shared.errors import InvalidRequestError, NotFoundError

MLX_WEIGHTS, PEFT_WEIGHTS, CONFIG = "adapters.safetensors", "adapter_model.safetensors", "adapter_config.json"
# Hugging Face expert projections under the names mlx_lm's switch layers take (Mixtral spells them w1..w3).
_EXPERT_PROJ = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"^(?P<moe>.*)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)$")


@dataclass
class AdapterWeights:
    """One adapter read from disk: ``modules[path] = (a, b)`` (see the module docstring for shapes)."""

    path: str
    rank: int
    modules: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def read_adapter(path: str) -> AdapterWeights:
    """Read an adapter directory in either format.

    NotFoundError (404) when the directory or its files are missing;
    InvalidRequestError (400) for anything in them mlxd cannot use.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise NotFoundError(f"no LoRA adapter at {path!r}: not a directory", param="lora_path")
    config_file = root / CONFIG
    if not config_file.is_file():
        raise NotFoundError(f"no LoRA adapter at {path!r}: {CONFIG} is missing", param="lora_path")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"LoRA adapter {path!r}: {CONFIG} is not JSON: {e}", param="lora_path") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"LoRA adapter {path!r}: {CONFIG} is not an object", param="lora_path")
    if (root / MLX_WEIGHTS).is_file():
        modules = _mlx_lm(root / MLX_WEIGHTS, config, path)
    elif (root / PEFT_WEIGHTS).is_file():
        modules = _peft(root / PEFT_WEIGHTS, config, path)
    else:
        raise NotFoundError(f"no LoRA adapter at {path!r}: neither {MLX_WEIGHTS} nor {PEFT_WEIGHTS}",
                            param="lora_path")
    if not modules:
        raise InvalidRequestError(f"LoRA adapter {path!r} holds no LoRA weights", param="lora_path")
    rank = max(a.shape[-1] for a, _ in modules.values())
    return AdapterWeights(str(root), rank, modules)


def _bad(path: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {path!r}: {what}", param="lora_path")


def _load(file: Path, path: str) -> dict[str, np.ndarray]:
    try:
        tensors = mx.load(str(file))
    except Exception as e:
        raise _bad(path, f"cannot read {file.name}: {e}") from None
    return {k: np.array(v.astype(mx.float32)) for k, v in tensors.items()}


def _number(config: dict, key: str, path: str, default=None) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(path, f"{CONFIG} needs a number for {key!r}")
    return float(value)


def _mlx_lm(file: Path, config: dict, path: str) -> dict:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise _bad(path, f"fine_tune_type {kind!r} is not served (only 'lora'; fuse a {kind} adapter instead)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise _bad(path, f"{CONFIG} has no lora_parameters object")
    scale = _number(params, "scale", path)
    tensors = _load(file, path)
    modules = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_a"):
            if not key.endswith(".lora_b"):
                raise _bad(path, f"tensor {key!r} is not a LoRA weight (lora_a/lora_b)")
            continue
        module = key[: -len(".lora_a")]
        b = tensors.get(module + ".lora_b")
        if b is None:
            raise _bad(path, f"{module}.lora_a has no lora_b")
        if a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[0]:
            modules[module] = (a, b * scale)
        elif a.ndim == 3 and b.ndim == 3 and a.shape[0] == b.shape[0] and a.shape[1] == b.shape[2]:
            modules[module] = (a.transpose(0, 2, 1), b.transpose(0, 2, 1) * scale)  # experts: [E, in, r], [E, r, out]
        else:
            raise _bad(path, f"{module}: lora_a {a.shape} and lora_b {b.shape} do not make a low-rank pair")
    missing = [k for k in tensors if k.endswith(".lora_b") and k[: -len(".lora_b")] not in modules]
    if missing:
        raise _bad(path, f"{missing[0]} has no lora_a")
    return modules


def _peft(file: Path, config: dict, path: str) -> dict:
    if config.get("peft_type", "LORA") != "LORA":
        raise _bad(path, f"peft_type {config.get('peft_type')!r} is not served (only LORA)")
    if config.get("use_dora"):
        raise _bad(path, "DoRA adapters are not served")
    tensors = _load(file, path)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, w in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(?P<m>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight", key)
        if match is None:
            raise _bad(path, f"tensor {key!r} is not a LoRA weight (lora_A/lora_B); modules_to_save are not served")
        if w.ndim != 2:
            raise _bad(path, f"{key} has shape {w.shape}, not a matrix")
        pairs.setdefault(match["m"], {})[match["ab"]] = w
    alpha = _number(config, "lora_alpha", path, config.get("r", 8))
    modules, experts = {}, {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
            raise _bad(path, f"{module}: lora_A and lora_B do not make a low-rank pair")
        r = ab["A"].shape[0]
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        a, b = ab["A"].T, ab["B"].T * scale
        expert = _EXPERT.match(module)
        if expert and expert["proj"] in _EXPERT_PROJ:
            target = f"{expert['moe']}.switch_mlp.{_EXPERT_PROJ[expert['proj']]}"
            experts.setdefault(target, {})[int(expert["e"])] = (a, b)
        else:
            modules[module] = (a, b)
    for target, per_expert in experts.items():
        modules[target] = _stack_experts(per_expert, target, path)
    return modules


def _stack_experts(per_expert: dict[int, tuple[np.ndarray, np.ndarray]], target: str, path: str):
    """Per-expert pairs as one switch layer's ``[E, in, r]`` / ``[E, r, out]``; absent experts get zeros.

    ``E`` here is one past the highest expert given; the registry pads to the model's count.
    """
    shapes = {(a.shape, b.shape) for a, b in per_expert.values()}
    if len(shapes) != 1:
        raise _bad(path, f"{target}: the experts' LoRA weights differ in shape")
    (a_shape, b_shape), = shapes
    n = max(per_expert) + 1
    a, b = np.zeros((n, *a_shape), np.float32), np.zeros((n, *b_shape), np.float32)
    for e, (ea, eb) in per_expert.items():
        a[e], b[e] = ea, eb
    return a, b
