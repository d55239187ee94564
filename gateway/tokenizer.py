"""The model's tokenizer and chat template, as the gateway uses them.

Loaded from the directory the engine names in its handshake (the engine's
loader materializes one for GGUF files), always offline.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from shared.errors import InvalidRequestError
from shared.hub import load_tokenizer


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
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for a conversation; InvalidRequestError for what the template rejects."""
        template = chat_template or self.chat_template or getattr(self.hf, "chat_template", None)
        if not template:
            raise InvalidRequestError(
                "this model has no chat template; start the gateway with --chat-template "
                "or use /v1/completions", param="messages")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message")
        if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
            raise InvalidRequestError(
                "continue_final_message needs a final assistant message", param="messages")
        kwargs = dict(chat_template_kwargs or {})
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
        except InvalidRequestError:
            raise
        except Exception as e:  # template errors (raise_exception, bad roles) are the request's fault
            raise InvalidRequestError(f"the chat template rejected the messages: {e}",
                                      param="messages") from None


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
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise InvalidRequestError("tool call arguments must be a JSON object",
                                          param=f"messages[{i}].tool_calls[{j}].function.arguments") from None
            call = {**call, "function": {**f, "arguments": args}}
        out.append(call)
    return out


def message_dicts(messages) -> list[dict]:
    """ChatMessage structs as the plain dicts chat templates expect; text parts joined."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role}
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"only text content parts are supported (got {part.get('type')!r})",
                        param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        d["content"] = content if content is not None else ""
        for name in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            v = getattr(m, name)
            if v is not None:
                d[name] = v
        if m.tool_calls:
            d["tool_calls"] = _template_tool_calls(m.tool_calls, i)
        out.append(d)
    return out
