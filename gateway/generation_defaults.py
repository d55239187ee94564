"""Sampling defaults for fields a request leaves out, as vLLM's ``--generation-config`` gives them.

``auto`` reads the model's ``generation_config.json`` (beside its tokenizer),
``vllm`` ignores it, and any other value names a folder holding one. The
operator's ``--override-generation-config`` JSON object is laid on top. Of a
generation config only the sampling keys count, with Hugging Face's names
(``max_new_tokens`` caps every request's max_tokens, as in vLLM); a request's
own value always wins over a default, except that the cap still applies.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from shared.errors import InvalidRequestError
from shared.serve_config import generation_sampling_keys


@dataclass(frozen=True)
class SamplingDefaults:
    """What an omitted sampling field means (OpenAI's defaults unless the model or operator says)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # None: no cap beyond the room the prompt leaves.
    max_tokens: int | None = None

    def cap(self, max_tokens: int) -> int:
        """``max_tokens`` within the operator's or model's ``max_new_tokens``."""
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)


def sampling_defaults(setting: str, model_dir: str, override: dict) -> SamplingDefaults:
    """The defaults for one model: ``setting`` is auto, vllm or a folder; ``override`` the operator's
    (GatewayConfig.generation_override)."""
    found: dict = {}
    if setting != "vllm":
        folder = model_dir if setting == "auto" else setting
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            except ValueError as e:
                raise InvalidRequestError(f"{path} is not JSON: {e}", param="generation_config") from None
            if isinstance(config, dict):
                found = generation_sampling_keys(config, path)
        elif setting != "auto":
            raise InvalidRequestError(f"--generation-config {setting}: no generation_config.json there",
                                      param="generation_config")
    return SamplingDefaults(**{**found, **override})
