"""OpenAI API request and response bodies as msgspec Structs.

Requests are decoded strictly (a string where a number belongs is a 400)
but unknown fields are ignored, as OpenAI's clients send fields this server
may not know. Beyond OpenAI's fields, requests take vLLM's sampling extras
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, skip_special_tokens) and chat-template controls.
"""

from __future__ import annotations

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Prefix-cache isolation: only requests with the same salt share cached blocks.
    cache_salt: str | None = None
    # vLLM's: a lower priority is admitted earlier.
    priority: int = 0
    # False opts this request out of speculative decoding.
    speculate: bool = True
    # vLLM's constraint: exactly one of json, regex, choice, grammar, json_object.
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older names for structured_outputs' json, regex, choice and grammar.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = None
    # vLLM's fields this server does not implement: a request that sets one is refused, not ignored.
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    # A string, or a list of parts like {"type": "text", "text": ...}.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of lists of them;
    # msgspec cannot tell list shapes apart in a union, so params.completion_prompts checks the shape.
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # As in chat: text, json_object or json_schema.
    response_format: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# -- responses -------------------------------------------------------------------------

class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(counts: tuple[int, int, int]) -> Usage:
    """OpenAI's usage of (prompt tokens, completion tokens, cached prompt tokens)."""
    prompt, completion, cached = counts
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob] | None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class AssistantMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = None
    # Present only when a tool-call or reasoning parser is in use.
    tool_calls: list[dict[str, Any]] | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | None | msgspec.UnsetType = msgspec.UNSET
    # The same text under the name llama.cpp and older vLLM use.
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    # Present (null) on every chunk when the client asked for include_usage; absent otherwise.
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | msgspec.UnsetType = msgspec.UNSET
    object: str = "text_completion"
