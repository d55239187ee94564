"""From an OpenAI request body to the engine's terms: prompt token ids and SamplingParams.

Everything here raises InvalidRequestError naming the offending field, before
anything reaches the engine.
"""

from __future__ import annotations

from gateway.generation_defaults import SamplingDefaults
from shared.errors import ContextLengthError, InvalidRequestError
from shared.protocol import EngineInfo
from shared.sampling import SamplingParams, StructuredSpec

MAX_STOP_STRINGS = 16


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return [s for s in stops if s]


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    """A string, list of strings, list of token ids, or list of lists of token ids."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=True)]
    if not prompt:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if all(isinstance(x, str) for x in prompt):
        return [tokenizer.encode(x, add_special_tokens=True) for x in prompt]
    if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return [list(prompt)]
    if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
           for x in prompt):
        return [list(x) for x in prompt]
    raise InvalidRequestError(
        "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
        param="prompt")


def check_prompt(ids: list[int], info: EngineInfo, max_tokens: int | None, param: str) -> int:
    """Validate one prompt against the context; returns the max_tokens to use."""
    if not ids:
        raise InvalidRequestError("the prompt is empty", param=param)
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {info.vocab_size})", param=param)
    room = info.max_model_len - len(ids)
    if room < 1:
        raise ContextLengthError(
            f"This model's maximum context length is {info.max_model_len} tokens; "
            f"the prompt has {len(ids)} tokens.", param=param,
            prompt_tokens=len(ids), max_model_len=info.max_model_len)
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise ContextLengthError(
            f"This model's maximum context length is {info.max_model_len} tokens. However, you "
            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
            f"in the completion).", param="max_tokens")
    return max_tokens


def sampling_params(req, max_tokens: int, logprobs: int | None, info: EngineInfo,
                    structured: StructuredSpec | None = None,
                    defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """SamplingParams of one choice, ``defaults`` for omitted fields; validated against the model's vocabulary."""
    bias = None
    if req.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None
        if any(not -100 <= v <= 100 for v in bias.values()):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", param="logit_bias")
    p = SamplingParams(
        max_tokens=defaults.cap(max_tokens),
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        top_k=defaults.top_k if req.top_k is None else req.top_k,
        min_p=defaults.min_p if req.min_p is None else req.min_p,
        repetition_penalty=(defaults.repetition_penalty if req.repetition_penalty is None
                            else req.repetition_penalty),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=bias,
        seed=req.seed,
        logprobs=logprobs,
        min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        speculate=req.speculate,
        structured=structured,
    )
    p.validate(info.vocab_size)
    return p


def requested_max_tokens(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise InvalidRequestError(f"{param} must be at least 1", param=param)
    return value


# vLLM's request fields the engine cannot honour yet: refused rather than silently ignored.
_UNSUPPORTED = ("prompt_logprobs", "bad_words", "allowed_token_ids")


def refuse_unsupported(req) -> None:
    for name in _UNSUPPORTED:
        if getattr(req, name) is not None:
            raise InvalidRequestError(f"{name} is not supported by this server", param=name)


def truncate_prompt(ids: list[int], keep: int | None, info: EngineInfo) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the context's worth)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = info.max_model_len
    if keep < 1:
        raise InvalidRequestError("truncate_prompt_tokens must be -1 or at least 1",
                                  param="truncate_prompt_tokens")
    return ids[-keep:]
