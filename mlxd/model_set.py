"""The models of one `mlxd serve` (or `mlxd service install`): each its engine's config, endpoint and
metrics port.

`mlxd serve A B` serves A and B with the command line's engine flags. A models file
(``--models-file``, TOML or JSON) gives each model its own: a list ``models`` of tables, each an
EngineConfig's fields by name (``model``, ``served_model_name``, ``max_model_len``,
``num_kv_blocks`` or ``kv_cache_memory``, ``speculative_config``, ``enable_lora``,
``lora_modules``, ...), laid over the command line's flags::

    [[models]]
    model = "Qwen/Qwen3-8B-MLX-4bit"
    max_model_len = 32768
    kv_cache_memory = "4G"

The engines share the machine: one whose table sets no ``gpu_memory_utilization`` gets the command
line's divided by the number of models, so that their memory guards and KV pools, each sized from
its own fraction, add up to the set's. Each engine gets the served name the gateway routes by
(``served_model_name``, else the name the loader would give: a GGUF file's stem, a directory's
name, a repo id), and an endpoint and metrics port of its own: the n-th model (from 0) the base endpoint with ``-n`` before its
extension (ipc) or its port plus n (tcp), and ``--metrics-port`` plus n.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import msgspec

from mlxd.flags import HUMAN_INTS, human_readable_int
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.serve_config import DaemonConfig


@dataclass
class ModelPlan:
    name: str
    engine: EngineConfig
    daemon: DaemonConfig

    @property
    def endpoint_entry(self) -> str:
        """The gateway's ``--model-endpoints`` entry for this engine."""
        return f"{self.name}={self.daemon.engine_endpoint}"


def derived_name(model: str) -> str:
    """The name the engine's loader gives ``model`` (engined/loaders: load_model's model_id)."""
    path = Path(model).expanduser()
    if model.lower().endswith(".gguf"):
        return path.stem
    if model.startswith((".", "/", "~")) or path.exists():
        return path.resolve().name
    return model


def nth_endpoint(endpoint: str, n: int) -> str:
    """The n-th engine's endpoint of a set, from the base one (see the module doc)."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + n}"
    root, ext = os.path.splitext(endpoint)
    return f"{root}-{n}{ext}"


def read_models_file(path: str) -> list[dict]:
    """The ``models`` tables of a TOML or JSON file (JSON: also a bare list)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InvalidRequestError(f"--models-file {path}: {e.strerror}", param="models_file") from None
    try:
        doc = json.loads(data) if path.lower().endswith(".json") else tomllib.loads(data.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"--models-file {path}: {e}", param="models_file") from None
    models = doc if isinstance(doc, list) else doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise InvalidRequestError(f"--models-file {path}: expected a non-empty list of tables named models",
                                  param="models_file")
    return models


def _engine_config(base: EngineConfig, fields: dict, where: str) -> EngineConfig:
    """``base`` with ``fields`` (EngineConfig's names, dashes allowed; sizes as "4G") laid over it."""
    merged = msgspec.structs.asdict(base)
    known = {f.name for f in msgspec.structs.fields(EngineConfig)}
    for key, value in fields.items():
        name = key.replace("-", "_")
        if name not in known:
            raise InvalidRequestError(f"{where}: unknown setting {key!r}", param="models_file")
        if name in HUMAN_INTS and isinstance(value, str):
            value = human_readable_int(value)
        merged[name] = value
    try:
        return msgspec.convert(merged, EngineConfig)
    except msgspec.ValidationError as e:
        raise InvalidRequestError(f"{where}: {e}", param="models_file") from None


def plan_models(base: EngineConfig, daemon: DaemonConfig, models: list[str],
                models_file: str | None) -> list[ModelPlan]:
    """One plan per model: the positional ``models``, then the file's; ``daemon.engine_endpoint`` set."""
    entries = [({"model": m}, m) for m in models]
    if models_file:
        entries += [(m, f"--models-file {models_file}, model {i + 1}")
                    for i, m in enumerate(read_models_file(models_file))]
    plans = []
    share = msgspec.structs.replace(base, gpu_memory_utilization=base.gpu_memory_utilization / len(entries))
    for n, (fields, where) in enumerate(entries):
        if not fields.get("model"):
            raise InvalidRequestError(f"{where}: each model of a set is named (model = ...)", param="model")
        engine = _engine_config(share, fields, where)
        engine.served_model_name = engine.served_model_name or derived_name(engine.model)
        port = daemon.metrics_port
        d = msgspec.structs.replace(daemon, engine_endpoint=nth_endpoint(daemon.engine_endpoint, n),
                                    metrics_port=port + n if port else port)
        plans.append(ModelPlan(engine.served_model_name, engine, d))
    names = [p.name for p in plans]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"two models of the set have one name ({names}); give one a served_model_name",
                                  param="served_model_name")
    return plans
