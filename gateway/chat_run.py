"""One chat generation described in OpenAI's chat terms, whichever API the request came in by.

/v1/chat/completions, Anthropic's Messages and OpenAI's Responses translate
their bodies into a ``ChatInput`` (template-ready message dicts, OpenAI
function tools, a tool_choice, sampling fields) and drive a ``ChatRun``: one
template, tool-choice grammar, stop strings, parsers and engine requests for
all three, with only the output's shape left to the caller. Rendering and
tokenizing run in a worker thread, off the event loop; a client that hangs up
before its answer begins (its prompt still waiting for a thread, say) is never
sent to the engine.

Each choice's text is split by a ``ChatOutput`` into reasoning, content and
tool calls. Reasoning is split off first (``<think>…</think>``); what remains
goes to the tool-call parser. Both read incrementally, and non-streaming is
one feed of the whole text, so a streamed choice adds up to exactly the
non-streamed one.

OpenAI's own chat route, POST /v1/chat/completions (``chat_completions``, at
the end), is here too: its body is already in a ChatInput's terms, so the
route is only that translation in and OpenAI's JSON or chunks out. The
routes of the other APIs keep their own modules (``anthropic``,
``responses``).

Over 400 lines because the three chat APIs share this one run (parsers, tool calls, reasoning,
streamed and whole answers alike); split, each API would keep a copy of it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from mlxd.gateway import openai_types as t
from mlxd.gateway import params as P
from mlxd.gateway.errors import sse_error_event
from mlxd.gateway.generation import DONE, KEEPALIVE, Generation, SSEResponse, event, while_connected
from mlxd.gateway.media import read_image, take_images
from mlxd.gateway.media_processor import expand, image_processor
from mlxd.gateway.parsers import (REASONING_PARSERS, ReasoningStream, ToolParser, ToolStream, keeps_special_tokens,
                             parse_complete)
from mlxd.gateway.state import GatewayState, open_request
from mlxd.gateway.structured import (NO_TOOLS, ToolPlan, marker_literal, one_spec, reasoning_aware, response_format_spec,
                                structured_outputs_spec, tool_plan)
from mlxd.shared.errors import InvalidRequestError, MlxdError
from mlxd.shared.protocol import ImageInput, Logprob


@dataclass
class ChatInput:
    """A chat request in OpenAI's terms; ``param`` names the field prompt errors point at.

    Sampling fields are None where the client gave none (the engine's default).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = field(default_factory=list)
    response_format: dict[str, Any] | None = None
    # The last (assistant) message is the start of the answer, continued rather than closed.
    continue_final: bool = False
    param: str = "messages"
    # A max_tokens past the room the prompt leaves is cut to it rather than refused (Anthropic's clients).
    clamp_max_tokens: bool = False
    # vLLM's: keep only the prompt's last N tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = None
    # The app of the request's key (per-app accounting in the engine).
    app: str | None = None
    # The field max_tokens came in as (max_completion_tokens, max_output_tokens), for errors.
    max_tokens_param: str = "max_tokens"
    # None: unless continue_final.
    add_generation_prompt: bool | None = None
    # OpenAI chat's and vLLM's further fields.
    n: int | None = None
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # None: no logprobs; k: the sampled token's and the top k.
    logprobs: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    speculate: bool = True
    priority: int = 0
    cache_salt: str | None = None
    # The LoRA adapter the request's model names (GatewayState.lora_name); None: the base model.
    lora_name: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass
class Prompt:
    """A ChatInput rendered and checked against the engine: what count_tokens reports."""

    text: str
    ids: list[int]
    max_tokens: int
    tools: ToolPlan
    # Its images, placed among ``ids`` by the model's processor (gateway.media_processor).
    images: list[ImageInput] | None = None


async def render(gw: GatewayState, inp: ChatInput, receive, check_length: bool = True) -> Prompt:
    """Check, template and tokenize; InvalidRequestError (400) for anything the engine would refuse,
    ClientGoneError when the client (ASGI ``receive``) hangs up first.

    Without ``check_length`` a prompt longer than the context is still counted
    (clients count tokens to learn that they must shorten the conversation),
    up to a few contexts' worth of text.
    """
    info, tok = gw.require_ready()
    cfg = gw.config
    add_generation_prompt = (not inp.continue_final if inp.add_generation_prompt is None
                             else inp.add_generation_prompt)
    P.check_chat(inp.messages, inp.param, add_generation_prompt, inp.continue_final, inp.chat_template,
                 cfg.trust_request_chat_template)
    max_tokens = P.requested_max_tokens(inp.max_tokens, inp.max_tokens_param)
    plan = NO_TOOLS
    if inp.tools or inp.tool_choice is not None:
        plan = tool_plan(inp.tools, inp.tool_choice, inp.parallel_tool_calls, gw.parsers.tool,
                         cfg.enable_auto_tool_choice, marker_literal(tok), gw.parsers.tool_format)

    # A message's content stays a list of parts only when it holds an image (params.message_dicts).
    has_parts = any(isinstance(m.get("content"), list) for m in inp.messages)
    urls = take_images(inp.messages, cfg.images_per_prompt) if has_parts else []
    images = None
    if urls:
        def read_images():
            image_processor(info.tokenizer_dir, info.served_model_name)  # a text-only model's 400 comes first
            return [read_image(u, k, cfg) for k, u in enumerate(urls)]

        pictures = await while_connected(asyncio.to_thread(read_images), receive)

    def template_and_tokenize() -> tuple[str, list[int]]:
        nonlocal images
        # None rather than []: templates test ``if tools``.
        text = tok.render_chat(
            inp.messages, tools=inp.tools or None, chat_template=inp.chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=inp.continue_final,
            chat_template_kwargs=inp.chat_template_kwargs,
            max_steps=P.TEMPLATE_MAX_STEPS if inp.chat_template is not None else None)
        P.check_prompt_bytes(text, info, tok.max_token_bytes, inp.param, slack=1 if check_length else 4)
        if urls:
            ids, images = expand(info.tokenizer_dir, info.served_model_name, text, pictures, info.max_image_pixels)
            return text, ids
        return text, tok.encode(text, add_special_tokens=False)

    text, ids = await while_connected(asyncio.to_thread(template_and_tokenize), receive)
    cut = P.truncate_prompt(ids, inp.truncate_prompt_tokens, info)
    if images and len(cut) < len(ids):  # the images' places would move, or fall off the front
        raise InvalidRequestError("truncate_prompt_tokens cannot cut a prompt with images",
                                  param="truncate_prompt_tokens")
    ids = cut
    if not check_length:
        return Prompt(text, ids, 0, plan, images)
    room = info.max_model_len - len(ids)
    if inp.clamp_max_tokens and max_tokens is not None and room >= 1:
        max_tokens = min(max_tokens, room)
    return Prompt(text, ids, P.check_prompt(ids, info, max_tokens, inp.param, inp.max_tokens_param), plan, images)


class ChatOutput:
    """Splits one choice; ``feed`` per streamed text delta, ``finish`` at its end, or ``whole`` at once."""

    def __init__(self, reasoning_parser: str | None, prompt_text: str, tool_parser: ToolParser | None):
        self.reasoning = None
        if reasoning_parser:
            cls = REASONING_PARSERS[reasoning_parser]
            self.reasoning = cls(starts_inside=cls.prompt_opens_reasoning(prompt_text))
        self.tool_parser = tool_parser
        self._rstream = ReasoningStream(self.reasoning) if self.reasoning else None
        self._tstream = ToolStream(tool_parser) if tool_parser else None
        # The choice's finish_reason once read whole (tool_calls when it called tools).
        self.final_reason: str | None = None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_parser is not None

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """(reasoning delta, content delta, tool-call deltas) for a text delta."""
        reasoning = ""
        if self._rstream is not None:
            reasoning, text = self._rstream.feed(text, final)
        if self._tstream is None:
            return reasoning, text, []
        content, calls = self._tstream.feed(text, final)
        return reasoning, content, calls

    def finish(self) -> tuple[str, str, list[dict]]:
        return self.feed("", final=True)

    @property
    def called_tools(self) -> bool:
        return self._tstream is not None and self._tstream.num_calls > 0

    @property
    def calls_ended(self) -> bool:
        """The tool-call list ended at a repeated call: the rest of the generation is not wanted."""
        return self._tstream is not None and self._tstream.ended

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        """Non-streaming: (reasoning or None, content or None, tool_calls)."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
        calls: list[dict] = []
        if self.tool_parser is not None:
            text, calls = parse_complete(self.tool_parser, text)
            if calls and not text.strip():
                text = None
        return reasoning, text, calls


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """A choice that ended by itself after tool calls reports ``tool_calls``."""
    return "tool_calls" if called_tools and reason == "stop" else reason


@dataclass
class Piece:
    """What one engine output added to one choice: reasoning text, content text, OpenAI tool-call
    deltas, whether it ended (and why: stop, length, abort, tool_calls), and its tokens' logprobs."""

    reasoning: str
    content: str
    calls: list[dict]
    finished: bool
    index: int = 0
    logprobs: list[tuple[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None


class ChatRun:
    """One generation of a ChatInput (``n`` choices): streamed as Pieces or collected whole.

    Construct, then ``await start()``; the prompt, the id and the choices exist from then on.
    ``receive`` is the HTTP request's ASGI receive, watched for the client's leaving.
    """

    def __init__(self, gw: GatewayState, inp: ChatInput, receive):
        self._gw = gw
        self.inp = inp
        self._receive = receive
        self.prompt: Prompt | None = None
        self.gen: Generation | None = None
        self.outputs: list[ChatOutput] = []
        self.keepalive = gw.config.sse_keepalive
        self._deltas = None

    @property
    def id(self) -> str:
        return self.gen.id_base

    @property
    def choices(self):
        return self.gen.choices

    @property
    def choice(self):
        return self.gen.choices[0]

    @property
    def output(self) -> ChatOutput:
        return self.outputs[0]

    async def start(self) -> None:
        """Check and render the request, then send it. A constrained one waits for its first
        output, so that a grammar the engine refuses is a 400 before any response starts
        rather than an error mid-stream. A client that hangs up meanwhile is ClientGoneError:
        its requests are never sent, or aborted."""
        gw, inp = self._gw, self.inp
        info, tok = gw.require_ready()
        P.check_task(info, "generate")
        n = P.check_n(inp.n)
        P.check_priority(inp.priority)
        stops = P.stop_list(inp.stop)
        self.prompt = prompt = await render(gw, inp, self._receive)
        reasoning_parser = gw.parsers.reasoning
        spec = None
        if inp.response_format or inp.structured_outputs or prompt.tools.spec is not None:
            spec = one_spec(("response_format", response_format_spec(inp.response_format)),
                            ("structured_outputs", structured_outputs_spec(inp.structured_outputs)),
                            ("tool_choice", prompt.tools.spec))
            spec = reasoning_aware(spec, reasoning_parser, prompt.text, marker_literal(tok))
        params = P.sampling_params(inp, prompt.max_tokens, inp.logprobs, info.vocab_size, n, spec,
                                   gw.sampling_defaults)
        parser = prompt.tools.parser
        # Formats whose markers are special tokens need them in the text to be parsed (no parser, no markers).
        parsed = parser is not None or reasoning_parser is not None
        skip_special = inp.skip_special_tokens and not (parsed and keeps_special_tokens(parser, reasoning_parser))
        self.gen = Generation(gw.client, tok, [prompt.ids], params, n, stops, inp.include_stop_str_in_output,
                              skip_special, inp.logprobs is not None, inp.cache_salt, inp.app, inp.priority,
                              inp.lora_name, prompt.images)
        self.outputs = [ChatOutput(reasoning_parser, prompt.text, parser) for _ in self.gen.choices]
        self.gen.start()
        try:
            self._deltas = await while_connected(self.gen.primed_deltas(self.keepalive, wait_first=spec is not None),
                                                 self._receive)
        except MlxdError as e:
            raise self._engine_error(e) from None

    def _engine_error(self, e: MlxdError) -> MlxdError:
        given = self.inp.max_tokens_param if self.inp.max_tokens is not None else None
        return P.engine_error(e, self.inp.param, given)

    async def _raw(self):
        try:
            async for d in self._deltas:
                yield d
        except MlxdError as e:
            raise self._engine_error(e) from None

    async def pieces(self):
        """Yield Pieces as the text arrives, and None after each idle keep-alive interval."""
        try:
            async for d in self._raw():
                if d is None:
                    yield None
                    continue
                out = self.outputs[d.index]
                final = d.finish_reason is not None
                reasoning, content, calls = out.feed(d.text, final=final)
                engine_reason = d.finish_reason
                if not final and out.calls_ended:
                    self.gen.end_choice(d.index)
                    final, engine_reason = True, "stop"
                if reasoning or content or calls or final or d.logprobs:
                    reason = finish_reason(engine_reason, out.called_tools) if final else None
                    yield Piece(reasoning, content, calls, final, d.index, d.logprobs, reason)
        finally:
            self.gen.abort_unfinished()

    async def collect(self) -> bool:
        """Run to the end; False when the client hung up (the generation is aborted).

        The text is read as it comes, as when streaming, so that a choice ends where a
        streamed one would (a tool-call list that repeats a call)."""
        return await self.gen.collect(self._receive, self.pieces())

    def whole(self, index: int = 0) -> tuple[str | None, str | None, list[dict]]:
        """A finished choice as (reasoning, content, OpenAI tool_calls), parsed from its whole text."""
        return self.outputs[index].whole(self.gen.choices[index].text)

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


# POST /v1/chat/completions: an OpenAI chat request as a ChatInput, its ChatRun's choices as OpenAI's answer.


def chat_input(req: t.ChatCompletionRequest, app: str | None) -> ChatInput:
    P.check_stream_options(req)
    P.refuse_unsupported(req)
    max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
    return ChatInput(
        P.message_dicts(req.messages), tools=req.tools, tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls, max_tokens=max_tokens, max_tokens_param=max_tokens_param,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stop=req.stop,
        response_format=req.response_format, continue_final=req.continue_final_message,
        add_generation_prompt=req.add_generation_prompt, app=app, n=req.n, seed=req.seed, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, logit_bias=req.logit_bias,
        logprobs=P.chat_logprobs(req.logprobs, req.top_logprobs), min_tokens=req.min_tokens,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, speculate=req.speculate,
        priority=req.priority, cache_salt=req.cache_salt,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, structured_outputs=P.structured_outputs_of(req),
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs)


async def chat_completions(request: Request) -> Response:
    gw, app, req, model = await open_request(request, t.ChatCompletionRequest)
    inp = chat_input(req, app)
    inp.lora_name = gw.lora_name(model)
    run = ChatRun(gw, inp, request.receive)
    await run.start()
    rid = "chatcmpl-" + run.id
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_stream(gw, run, rid, created, model, include_usage),
                           on_close=run.gen.abort_unfinished)
    if not await run.collect():
        return Response(status_code=499)  # nobody is listening; nginx's 'client closed request'
    choices = []
    for c in run.choices:
        message, reason = _message(run, c)
        lps = t.ChatLogprobs(token_logprobs(gw.tokenizer, c.logprobs)) if run.inp.logprobs is not None else None
        choices.append(t.ChatChoice(index=c.index, message=message, logprobs=lps, finish_reason=reason))
    body = t.ChatCompletion(id=rid, created=created, model=model, choices=choices, usage=t.usage(run.usage()))
    return Response(msgspec.json.encode(body), media_type="application/json")


def _message(run: ChatRun, choice) -> tuple[t.AssistantMessage, str | None]:
    """A whole choice's message and finish_reason (tool_calls when it ended after calling tools)."""
    out = run.outputs[choice.index]
    reasoning, content, calls = run.whole(choice.index)
    msg = t.AssistantMessage(content=content)
    if out.tool_parser is not None:
        msg.tool_calls = calls
    if out.reasoning is not None:
        msg.reasoning = msg.reasoning_content = reasoning
    return msg, finish_reason(choice.finish_reason, bool(calls))


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def token_logprobs(tok, entries) -> list[t.TokenLogprob]:
    out = []
    for token_id, lp in entries:
        text = tok.token_text(token_id)
        tops = [t.TopLogprob(token=tok.token_text(i), logprob=v, bytes=_token_bytes(tok.token_text(i)))
                for i, v in zip(lp.top_ids, lp.top_logprobs)]
        out.append(t.TokenLogprob(token=text, logprob=lp.logprob, bytes=_token_bytes(text),
                                  top_logprobs=tops))
    return out


async def _stream(gw: GatewayState, run: ChatRun, rid: str, created: int, model: str, include_usage: bool):
    usage_field = None if include_usage else msgspec.UNSET

    def chunk(choice: t.ChatChunkChoice) -> bytes:
        return event(t.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice],
                                           usage=usage_field))

    try:
        for c in run.choices:
            yield chunk(t.ChatChunkChoice(index=c.index, delta=t.Delta(role="assistant", content="")))
        async for p in run.pieces():
            if p is None:
                yield KEEPALIVE
                continue
            lp = t.ChatLogprobs(token_logprobs(gw.tokenizer, p.logprobs)) if p.logprobs else None
            if p.content or p.reasoning or lp is not None:
                delta = t.Delta(content=p.content or None, reasoning=p.reasoning or None,
                                reasoning_content=p.reasoning or None)
                yield chunk(t.ChatChunkChoice(index=p.index, delta=delta, logprobs=lp))
            # One chunk per tool-call delta: a call's name, then its argument increments.
            for call in p.calls:
                yield chunk(t.ChatChunkChoice(index=p.index, delta=t.Delta(tool_calls=[call])))
            if p.finished:
                yield chunk(t.ChatChunkChoice(index=p.index, delta=t.Delta(), finish_reason=p.finish_reason))
        if include_usage:
            yield event(t.ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                              usage=t.usage(run.usage())))
        yield DONE
    except MlxdError as e:
        yield sse_error_event(e)
