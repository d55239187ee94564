"""The drafter a speculative engine proposes with, loaded and checked against its target.

``draft_model``: a second, smaller checkpoint that must share the target's
vocabulary. ``mtp``: the target checkpoint's own multi-token-prediction layer,
which the loader set aside (``LoadedModel.mtp``); it reads the target's final
hidden states and head, so it is built on the target's runner. ``mtp`` with a
``model``: a separate MTP drafter, Gemma 4's assistant (``gemma4_assistant``),
which reads the target's hidden states and K/V; given as a draft model, it is
read as ``mtp`` (``resolve``).
"""

from __future__ import annotations

import mlx.core as mx
import msgspec

from mlxd.engined.kv.manager import KVCacheManager
from mlxd.engined.loaders import LoadedModel, load_model
from mlxd.engined.model_layers import read_layers
from mlxd.engined.runner import LastTokenNorm
from mlxd.engined.sampler import Sampler
from mlxd.engined.speculation.draft_model import DraftProposer
from mlxd.engined.speculation.gemma4_assistant import Gemma4AssistantProposer, assistant_dir, load_assistant
from mlxd.engined.speculation.mtp import MTPProposer, build_layer
from mlxd.shared.config import EngineConfig, SpeculativeConfig
from mlxd.shared.errors import InvalidRequestError, ModelLoadError


def resolve(spec: SpeculativeConfig | None) -> SpeculativeConfig | None:
    """``spec`` with the method its drafter checkpoint implies: a Gemma 4 assistant is MTP."""
    if spec is None or spec.method != "draft_model" or assistant_dir(spec.model) is None:
        return spec
    return msgspec.structs.replace(spec, method="mtp")


def load_drafter(spec: SpeculativeConfig, target: LoadedModel, config: EngineConfig, dtype: mx.Dtype,
                 sampler: Sampler, backend: str) -> DraftProposer:
    draft = load_model(spec.model, config.dtype)
    if draft.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens; "
            f"the target's has {target.vocab_size}: they must share a tokenizer"
        )
    return DraftProposer(draft.model, read_layers(draft.model), config.block_size, dtype, sampler, backend)


def load_mtp(spec: SpeculativeConfig, loaded: LoadedModel, head: LastTokenNorm, kv: KVCacheManager,
             config: EngineConfig, dtype: mx.Dtype, sampler: Sampler,
             backend: str) -> MTPProposer | Gemma4AssistantProposer:
    if config.num_ranks > 1:
        raise InvalidRequestError("MTP speculation cannot run over several ranks yet", param="speculative_config")
    if spec.model is not None:
        directory = assistant_dir(spec.model)
        if directory is None:
            raise ModelLoadError(f"speculative method 'mtp' with a model takes a Gemma 4 assistant checkpoint "
                                 f"(model_type gemma4_assistant); {spec.model!r} is not one",
                                 param="speculative_config")
        assistant = load_assistant(directory, loaded.model, loaded.model_type)
        return Gemma4AssistantProposer(loaded.model, head, assistant, kv, sampler, config.block_size, backend)
    if loaded.mtp is None:
        raise ModelLoadError(f"{loaded.model_id} has no MTP layer (mtp.* weights) for "
                             "speculative method 'mtp'", param="speculative_config")
    layer, index = build_layer(loaded.model, loaded.model_type, loaded.mtp)
    return MTPProposer(loaded.model, head, layer, index, kv, sampler, config.block_size, dtype, backend)
