"""One chat generation described in OpenAI's chat terms, whichever API the request came in by.

Anthropic's Messages and OpenAI's Responses translate their bodies into a
``ChatInput`` (template-ready message dicts, OpenAI function tools, a
tool_choice, sampling fields) and drive a ``ChatRun``: the same template,
tool-choice grammar, stop strings, parsers and engine requests as
/v1/chat/completions, with only the output's shape left to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from gateway import params as P
from gateway.chat_output import ChatOutput
from gateway.generation import Generation
from gateway.state import GatewayState
from gateway.structured import (ToolPlan, marker_literal, one_spec, reasoning_aware, response_format_spec,
                                tool_plan)
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams


@dataclass
class ChatInput:
    """A chat request in OpenAI's terms; ``param`` names the field prompt errors point at."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    response_format: dict[str, Any] | None = None
    # The last (assistant) message is the start of the answer, continued rather than closed.
    continue_final: bool = False
    param: str = "messages"
    # A max_tokens past the room the prompt leaves is cut to it rather than refused (Anthropic's clients).
    clamp_max_tokens: bool = False
    # The app of the request's key (per-app accounting in the engine).
    app: str | None = None


@dataclass
class Prompt:
    """A ChatInput rendered and checked against the engine: what count_tokens reports."""

    text: str
    ids: list[int]
    max_tokens: int
    tools: ToolPlan


def render(gw: GatewayState, inp: ChatInput, check_length: bool = True) -> Prompt:
    """Template, tokenize and check; InvalidRequestError (400) for anything the engine would refuse.

    Without ``check_length`` a prompt longer than the context is still counted
    (clients count tokens to learn that they must shorten the conversation).
    """
    info, tok = gw.require_ready()
    if not inp.messages:
        raise InvalidRequestError("the conversation is empty", param=inp.param)
    max_tokens = P.requested_max_tokens(inp.max_tokens, "max_tokens")
    cfg = gw.config
    plan = tool_plan(inp.tools, inp.tool_choice, inp.parallel_tool_calls, cfg.tool_call_parser,
                     cfg.enable_auto_tool_choice, marker_literal(tok))
    # None rather than []: templates test ``if tools``.
    text = tok.render_chat(inp.messages, tools=inp.tools or None, add_generation_prompt=not inp.continue_final,
                           continue_final_message=inp.continue_final)
    ids = tok.encode(text, add_special_tokens=False)
    if not check_length:
        return Prompt(text, ids, 0, plan)
    room = info.max_model_len - len(ids)
    if inp.clamp_max_tokens and max_tokens is not None and room >= 1:
        max_tokens = min(max_tokens, room)
    return Prompt(text, ids, P.check_prompt(ids, info, max_tokens, inp.param), plan)


@dataclass
class Piece:
    """What one engine output added: reasoning text, content text, OpenAI tool-call deltas, the end."""

    reasoning: str
    content: str
    calls: list[dict]
    finished: bool


class ChatRun:
    """One started generation (n=1) of a ChatInput: streamed as Pieces or collected whole."""

    def __init__(self, gw: GatewayState, inp: ChatInput):
        info, tok = gw.require_ready()
        self.prompt = prompt = render(gw, inp)
        spec = one_spec(("response_format", response_format_spec(inp.response_format)),
                        ("tool_choice", prompt.tools.spec))
        spec = reasoning_aware(spec, gw.config.reasoning_parser, prompt.text, marker_literal(tok))
        d = gw.sampling_defaults
        params = SamplingParams(
            max_tokens=d.cap(prompt.max_tokens),
            temperature=d.temperature if inp.temperature is None else inp.temperature,
            top_p=d.top_p if inp.top_p is None else inp.top_p,
            top_k=d.top_k if inp.top_k is None else inp.top_k,
            min_p=d.min_p,
            repetition_penalty=d.repetition_penalty,
            structured=spec,
        )
        params.validate(info.vocab_size)
        self.constrained = spec is not None
        parser = prompt.tools.parser
        # Formats whose markers are special tokens need them in the text to be parsed.
        skip_special = not (parser and parser.special_markers)
        stops = P.stop_list(inp.stop)
        self.gen = Generation(gw.client, tok, [prompt.ids], params, 1, stops, False, skip_special, False,
                              app=inp.app)
        self.output = ChatOutput(gw.config.reasoning_parser, prompt.text, parser)
        self.keepalive = gw.config.sse_keepalive
        self._head: list = []
        self._deltas = None

    @property
    def id(self) -> str:
        return self.gen.id_base

    @property
    def choice(self):
        return self.gen.choices[0]

    async def start(self) -> None:
        """Send the request. A constrained one waits for its first output, so that a grammar
        the engine refuses is a 400 before any response starts rather than an error mid-stream."""
        self.gen.start()
        self._deltas = self.gen.deltas(keepalive=self.keepalive)
        if self.constrained:
            try:
                async for d in self._deltas:
                    if d is not None:
                        self._head.append(d)
                        break
            except BaseException:
                await self._deltas.aclose()
                raise

    async def _raw(self):
        for d in self._head:
            yield d
        async for d in self._deltas:
            yield d

    async def pieces(self):
        """Yield Pieces as the text arrives, and None after each idle keep-alive interval."""
        try:
            async for d in self._raw():
                if d is None:
                    yield None
                    continue
                final = d.finish_reason is not None
                reasoning, content, calls = self.output.feed(d.text, final=final)
                if reasoning or content or calls or final:
                    yield Piece(reasoning, content, calls, final)
        finally:
            self.gen.abort_unfinished()

    async def collect(self, request: Request) -> bool:
        """Run to the end; False when the client hung up (the generation is aborted)."""
        return await self.gen.collect(request.receive, self._raw())

    def whole(self) -> tuple[str | None, str | None, list[dict]]:
        """The finished choice as (reasoning, content, OpenAI tool_calls), parsed from its whole text."""
        return self.output.whole(self.choice.text)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the generation, if one did."""
        return self.choice.stops.matched

    @property
    def finish_reason(self) -> str | None:
        """The engine's reason: stop (eos or a stop string), length, abort."""
        return self.choice.finish_reason

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens)."""
        return self.gen.usage_counts()

