"""The one place a request's fields are checked and mapped to the engine's terms: prompts and SamplingParams.

Every route (chat completions, completions, Anthropic's messages, Responses)
goes through these functions, and everything here raises
InvalidRequestError naming the offending field, before anything reaches the
engine. The ranges of the sampling fields themselves are
``SamplingParams.validate``'s, which the engine applies again at its end of
the wire.

Sampling fields a request leaves out take defaults as vLLM's
``--generation-config`` gives them (``SamplingDefaults``, resolved once per
loaded model): ``auto`` reads the model's ``generation_config.json`` (beside
its tokenizer), ``vllm`` ignores it, and any other value names a folder
holding one. The operator's ``--override-generation-config`` JSON object is
laid on top. Of a generation config only the sampling keys count, with
Hugging Face's names (``max_new_tokens`` caps every request's max_tokens, as
in vLLM); a request's own value always wins over a default, except that the
cap still applies.

A JSON value a field carries as text (tool-call arguments) is decoded here
too, depth-checked (``loads``), as are whole bodies (``check_depth``).

A prompt's tokens come from here too: the model's tokenizer and chat template
(``Tokenizer``, at the end), loaded from the directory the engine names in its
handshake (the engine's loader materializes one for GGUF files), always
offline, and the messages as the plain dicts a template expects
(``message_dicts``).

Over 400 lines because every request field's range and shape is checked in this one place, so
that the engine and the wire never see a value they cannot hold.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxd.shared.errors import ContextLengthError, InvalidRequestError, MlxdError
from mlxd.shared.hub import load_tokenizer
from mlxd.shared.protocol import INT64_MAX, INT64_MIN, EngineInfo, SamplingParams, StructuredSpec
from mlxd.shared.serve_config import generation_sampling_keys

MAX_STOP_STRINGS = 16
MAX_N = 64
# Engine requests one HTTP request may start (prompts x n): each takes a place in the
# engine's waiting queue, and a batch of 1,000 prompts would otherwise fill it alone.
MAX_CHOICES = 64
# Roles a chat template is given; OpenAI's developer role arrives as system.
CHAT_ROLES = ("system", "user", "assistant", "tool")
# Python steps a request-supplied chat template may take to render (a long
# conversation through a model's own template takes a few hundred thousand).
TEMPLATE_MAX_STEPS = 5_000_000

# Deeper than any real tool schema or tool-call arguments (a dozen levels), far
# below what recursive code downstream (json, Jinja's tojson, grammar
# compilers) survives; msgspec itself gives up near 1,000.
MAX_JSON_DEPTH = 64


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


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return [s for s in stops if s]


def check_n(n: int | None) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}]", param="n")
    return n


def check_choices(num_prompts: int, n: int, param: str = "prompt") -> None:
    if num_prompts * n > MAX_CHOICES:
        raise InvalidRequestError(f"one request may ask for at most {MAX_CHOICES} completions "
                                  f"(prompts x n); this one asks for {num_prompts * n}", param=param)


def check_priority(priority: int) -> int:
    if not INT64_MIN <= priority <= INT64_MAX:
        raise InvalidRequestError("priority must fit in a signed 64-bit integer", param="priority")
    return priority


def check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")


def chat_logprobs(logprobs: bool, top_logprobs: int | None) -> int | None:
    """Chat's logprobs/top_logprobs as the engine's count: None (none), or the top k beside the sampled token."""
    if top_logprobs is not None and not logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def check_completion(req, n: int) -> None:
    """What /v1/completions takes beyond the shared sampling fields."""
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise InvalidRequestError("logprobs must be in [0, 20]", param="logprobs")
    if req.echo and req.stream:
        raise InvalidRequestError("echo is not supported with stream=true", param="echo")
    check_priority(req.priority)


def requested_max_tokens(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise InvalidRequestError(f"{param} must be at least 1", param=param)
    return value


def check_chat(messages: list[dict], param: str, add_generation_prompt: bool, continue_final: bool,
               chat_template: str | None, trust_request_template: bool) -> None:
    """The conversation and its template controls, before anything is rendered."""
    if not messages:
        raise InvalidRequestError("the conversation is empty", param=param)
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise InvalidRequestError(f"unknown role {m.get('role')!r}; a message's role is one of "
                                      f"{', '.join(CHAT_ROLES)} or developer", param=f"{param}[{i}].role")
    if add_generation_prompt and continue_final:
        raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true",
                                  param="continue_final_message")
    if continue_final and messages[-1]["role"] != "assistant":
        raise InvalidRequestError("continue_final_message needs a final assistant message", param=param)
    if chat_template is not None and not trust_request_template:
        raise InvalidRequestError("this server does not render request-supplied chat templates "
                                  "(start it with --trust-request-chat-template)", param="chat_template")


def check_prompt_bytes(text: str, info: EngineInfo, max_token_bytes: int | None, param: str,
                       slack: int = 1) -> None:
    """Refuse, before tokenizing it, a prompt whose text cannot fit in ``slack`` contexts.

    No token covers more than ``max_token_bytes`` bytes of text (see
    ``Tokenizer.max_token_bytes``), so a text of B bytes has at least
    B / max_token_bytes tokens; over ``slack * max_model_len`` such tokens it
    cannot fit, whatever the tokenizer makes of it.
    """
    if max_token_bytes is None:
        return
    limit = slack * info.max_model_len * max_token_bytes
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    if size > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {info.max_model_len} tokens; the prompt's "
            f"{size} bytes are more than {info.max_model_len * slack} tokens of this tokenizer can hold.",
            param=param)


def check_prompt(ids: list[int], info: EngineInfo, max_tokens: int | None, param: str,
                 max_tokens_param: str = "max_tokens") -> int:
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
            f"in the completion).", param=max_tokens_param)
    return max_tokens


def engine_error(err: MlxdError, prompt_param: str, max_tokens_param: str | None) -> MlxdError:
    """An engine's error with the request field it concerns.

    The engine speaks of prompts and KV blocks, not of HTTP fields (the
    gateway has checked the prompt against the context already, so what the
    engine can still refuse is the prompt plus its completion in the KV
    pool): a context-length refusal names the requested length when the
    client gave one, else the prompt.
    """
    if isinstance(err, ContextLengthError):
        err.param = max_tokens_param or prompt_param
    return err


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def structured_outputs_of(req) -> dict[str, Any] | None:
    """``structured_outputs``, or the same constraint under vLLM's older ``guided_*`` names."""
    guided = {new: getattr(req, old) for old, new in _GUIDED if getattr(req, old) is not None}
    if guided and req.structured_outputs:
        raise InvalidRequestError("structured_outputs and guided_* cannot both constrain the output",
                                  param="structured_outputs")
    if len(guided) > 1:
        raise InvalidRequestError("give at most one of guided_json, guided_regex, guided_choice, guided_grammar",
                                  param=next(old for old, new in _GUIDED if new in guided))
    return guided or req.structured_outputs


def sampling_params(req, max_tokens: int, logprobs: int | None, vocab_size: int, n: int = 1,
                    structured: StructuredSpec | None = None,
                    defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """SamplingParams of a request's choices, validated against the model's vocabulary.

    ``req`` has the sampling fields of OpenAI's and vLLM's requests (a
    ChatInput, a CompletionRequest), None where the client gave none: those
    take ``defaults`` (the model's generation config, the operator's override),
    whose cap also bounds ``max_tokens``.
    """
    bias = None
    if req.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None
        if any(not -100 <= v <= 100 for v in bias.values()):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", param="logit_bias")
    # Choices of one prompt are seeded seed, seed+1, ...: the last must still be an int64.
    if req.seed is not None and INT64_MIN <= req.seed <= INT64_MAX < req.seed + n - 1:
        raise InvalidRequestError("seed + n - 1 must fit in a signed 64-bit integer", param="seed")
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
    p.validate(vocab_size)
    return p


def completion_prompts(prompt, tokenizer, info: EngineInfo) -> list[list[int]]:
    """A string, list of strings, list of token ids, or list of lists of token ids, as token ids.

    Tokenizes: call it off the event loop. Texts that cannot fit are refused unread.
    """
    def encode(text: str) -> list[int]:
        check_prompt_bytes(text, info, tokenizer.max_token_bytes, "prompt")
        return tokenizer.encode(text, add_special_tokens=True)

    if isinstance(prompt, str):
        return [encode(prompt)]
    if not prompt:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if all(isinstance(x, str) for x in prompt):
        return [encode(x) for x in prompt]
    if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return [list(prompt)]
    if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
           for x in prompt):
        return [list(x) for x in prompt]
    raise InvalidRequestError(
        "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
        param="prompt")


def num_prompts(prompt) -> int:
    """How many prompts a completions ``prompt`` holds, before any is tokenized."""
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        return len(prompt)
    return 1


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


# What each task is asked for by, in error messages.
_TASK_ROUTES = {"generate": "text generation (chat, completions, messages, responses)",
                "embed": "embeddings (/v1/embeddings, /pooling)",
                "score": "scoring (/v1/score, /rerank)",
                "transcribe": "transcriptions (/v1/audio/transcriptions, /v1/audio/translations)"}


def check_task(info: EngineInfo, task: str) -> None:
    """400 when the served model does not do ``task`` (an embedding model asked to chat, ...)."""
    if task not in info.tasks:
        serves = " and ".join(_TASK_ROUTES[t] for t in info.tasks if t in _TASK_ROUTES)
        raise InvalidRequestError(f"the model `{info.served_model_name}` does not support {_TASK_ROUTES[task]}; "
                                  f"it serves {serves}", param="model")


def json_depth(value) -> int:
    """The nesting depth of decoded JSON (a scalar is 0, ``[]`` is 1), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def check_depth(value, param: str | None = None) -> None:
    if json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", param=param)


def loads(text: str | bytes, param: str | None = None):
    """Any JSON value, depth-checked; InvalidRequestError for what is not JSON or nests too deep."""
    try:
        value = msgspec.json.decode(text)
    except RecursionError:
        raise InvalidRequestError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", param=param) from None
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"not valid JSON: {e}", param=param) from None
    check_depth(value, param)
    return value


# The model's tokenizer and chat template.


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a Jinja template, or the path of a file holding one."""
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


class Tokenizer:
    def __init__(self, tokenizer_dir: str, chat_template: str | None = None):
        self.tokenizer_dir = tokenizer_dir
        self.hf = load_tokenizer(tokenizer_dir)
        # The Rust tokenizer decodes without transformers' clean-up rewriting of
        # spaces, so incremental and whole decodes agree.
        self._backend = getattr(self.hf, "backend_tokenizer", None) or getattr(self.hf, "_tokenizer", None)
        self.chat_template = chat_template
        self.max_token_bytes = self._max_token_bytes()

    def _max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text one token can stand for; None when no bound is known.

        A token's vocabulary entry is at least as long as the text it covers
        (byte-level BPE spells each byte as one or two bytes of UTF-8,
        SentencePiece a space as three, byte fallback a byte as six); its
        decoded text is taken too, for vocabularies spelled otherwise. A
        normalizer can shrink text before it is split (NFKC folds a 3-byte
        full-width letter to 1 byte, others drop characters), so with one no
        bound is claimed.
        """
        if self._backend is None or self._backend.normalizer is not None:
            return None
        longest = 0
        for piece, token_id in self.hf.get_vocab().items():
            text = self._backend.decode([token_id], skip_special_tokens=False)
            longest = max(longest, len(piece.encode("utf-8")), len(text.encode("utf-8")))
        return longest or None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = True):
        return functools.partial(self.decode, skip_special_tokens=skip_special_tokens)

    @functools.lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs (special tokens included)."""
        return self.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list, *, tools=None, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    max_steps: int | None = None) -> str:
        """The prompt text for a conversation; InvalidRequestError for what the template rejects.

        ``max_steps`` caps the Python steps of rendering (a request-supplied
        template can loop for as long as it likes); the fields themselves are
        checked by gateway.params before this is called.
        """
        template = chat_template or self.chat_template or getattr(self.hf, "chat_template", None)
        if not template:
            raise InvalidRequestError(
                "this model has no chat template; start the gateway with --chat-template "
                "or use /v1/completions", param="messages")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & _APPLY_PARAMETERS)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}",
                                      param="chat_template_kwargs")

        def apply():
            return self.hf.apply_chat_template(
                messages, tools=tools, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)

        try:
            return apply() if max_steps is None else step_capped(apply, max_steps)
        except TemplateStepsExceeded:
            raise InvalidRequestError(f"the chat template took more than {max_steps} steps to render",
                                      param="chat_template") from None
        except InvalidRequestError:
            raise
        except Exception as e:  # template errors (raise_exception, bad roles) are the request's fault
            raise InvalidRequestError(f"the chat template rejected the messages: {e}",
                                      param="messages") from None


# apply_chat_template's own arguments: chat_template_kwargs are template variables, never these.
_APPLY_PARAMETERS = frozenset(("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                               "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
                               "truncation", "max_length", "return_tensors", "return_dict",
                               "return_assistant_tokens_mask", "tokenizer_kwargs", "messages"))


class TemplateStepsExceeded(BaseException):
    """Not an Exception: template and library code that catches those must not swallow the cap."""


def step_capped(fn, max_steps: int):
    """``fn()`` in this thread, stopped with TemplateStepsExceeded after ``max_steps`` traced Python events.

    A count of steps rather than a clock, so the cap gives the same answer on
    a loaded machine; a trace function's exception surfaces in the traced
    frame, which is how the render is stopped from outside its own code.
    """
    steps = 0

    def trace(frame, event, arg):
        nonlocal steps
        steps += 1
        if steps > max_steps:
            raise TemplateStepsExceeded
        return trace

    sys.settrace(trace)
    try:
        return fn()
    finally:
        sys.settrace(None)
        if steps > max_steps:
            raise TemplateStepsExceeded


def _template_tool_calls(calls, i: int) -> list:
    """Tool calls of an assistant message with their arguments as objects.

    OpenAI sends arguments as a JSON string; chat templates (transformers'
    convention) expect a mapping and render it themselves.
    """
    out = []
    for j, call in enumerate(calls):
        f = call.get("function") if isinstance(call, dict) else None
        args = f.get("arguments") if isinstance(f, dict) else None
        if isinstance(args, str):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            args = loads(args, param=where) if args.strip() else {}
            call = {**call, "function": {**f, "arguments": args}}
        out.append(call)
    return out


def message_dicts(messages) -> list[dict]:
    """ChatMessage structs as the plain dicts chat templates expect; text parts joined."""
    out = []
    for i, m in enumerate(messages):
        if m.role == "tool" and m.tool_call_id is None:
            # OpenAI refuses it too: a result that names no call cannot be paired with one in the prompt.
            raise InvalidRequestError("a tool message needs the tool_call_id of the call it answers",
                                      param=f"messages[{i}].tool_call_id")
        # Chat templates know no developer role (OpenAI's newer name for system).
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        content = m.content
        if isinstance(content, list):
            texts, parts = [], []
            for part in content:
                if part.get("type") == "image_url":  # read by gateway.media; the template writes its placeholder
                    url = part.get("image_url")
                    parts.append({"type": "image", "url": url.get("url") if isinstance(url, dict) else url})
                    continue
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"only text and image_url content parts are supported (got {part.get('type')!r})",
                        param=f"messages[{i}].content")
                texts.append(part["text"])
                parts.append(part)
            # Text alone is joined, as templates that know no parts expect; with images the parts stay.
            content = "\n".join(texts) if len(parts) == len(texts) else parts
        d["content"] = content if content is not None else ""
        for name in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            v = getattr(m, name)
            if v is not None:
                d[name] = v
        if m.tool_calls:
            d["tool_calls"] = _template_tool_calls(m.tool_calls, i)
        out.append(d)
    return out
