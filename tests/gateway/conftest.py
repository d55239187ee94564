"""The real SmolLM2 tokenizer, materialized from the embedded GGUF the way the engine does it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    import mlx.core as mx

    from mlxd.engined.loaders import default_model_path
    from mlxd.engined.loaders.gguf_tokenizer import build_tokenizer_dir
    from mlxd.gateway.params import Tokenizer

    path = default_model_path()
    _, meta = mx.load(path, return_metadata=True)
    return Tokenizer(str(build_tokenizer_dir(meta, path)))
