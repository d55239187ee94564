"""The model's tokenizer and chat template, as the gateway uses them.

Loaded from the directory the engine names in its handshake (the engine's
loader materializes one for GGUF files), always offline.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from gateway.http_guards import loads
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
        # Chat templates know no developer role (OpenAI's newer name for system).
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
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
