"""The default GGUF as an mlx_lm model directory in float32, for mlx_lm.server.

mlxd dequantizes the GGUF to float32 on CPU (MLX's CPU quantized matmul is
slow); saving the same float32 weights gives mlx_lm.server the same dtype.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def mlx_lm_dir(out: Path, spec: str = "") -> Path:
    """Write (once) `out` with config.json, model.safetensors and the tokenizer files; returns `out`."""
    out = Path(out)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    from mlxd.engined.device import load_fast_blas

    load_fast_blas()  # before mlx.core (engined/device.py)
    from mlx_lm.utils import save_config, save_model

    from mlxd.engined.loaders import default_model_path, load_model
    from mlxd.engined.loaders.gguf import load_gguf

    path = spec or default_model_path()
    config = load_gguf(path).config  # the mlx_lm config the loader derived from the GGUF metadata
    loaded = load_model(path, dtype="float32")
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, loaded.model)
    config = {k: v for k, v in config.items() if k != "quantization"}
    save_config(config, out / "config.json")
    for f in Path(loaded.tokenizer_dir).iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out
