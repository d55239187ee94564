"""/v1/chat/completions and /v1/completions: request in, generation out (whole or streamed)."""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway import openai_types as t
from gateway import params as P
from gateway.chat_output import ChatOutput, finish_reason
from gateway.errors import RequestTooLargeError, sse_error_event
from gateway.generation import Generation, check_n
from gateway.sse import DONE, KEEPALIVE, SSEResponse, event
from gateway.state import GatewayState
from gateway.structured import (marker_literal, one_spec, reasoning_aware, response_format_spec,
                                structured_outputs_of, structured_outputs_spec, tool_plan)
from gateway.tokenizer import message_dicts
from shared.errors import InvalidRequestError, MlxdError

_json = msgspec.json.Encoder()


def _json_response(obj) -> Response:
    return Response(_json.encode(obj), media_type="application/json")


# Far above any context window's worth of text; stops a client from filling the gateway's memory.
MAX_BODY_BYTES = 64 << 20


async def read_body(request: Request) -> bytes:
    """The request body, refusing (413) one over MAX_BODY_BYTES before or while reading it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestTooLargeError(f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestTooLargeError(f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


async def _decode(request: Request, typ):
    return msgspec.json.decode(await read_body(request), type=typ)


def _check_common(req) -> None:
    P.refuse_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed with stream=true",
                                  param="stream_options")


async def chat_completions(request: Request) -> Response:
    gw: GatewayState = request.app.state.gw
    app = gw.check_auth(request)
    req = await _decode(request, t.ChatCompletionRequest)
    _check_common(req)
    info, tok = gw.require_ready()
    model = gw.check_model(req.model)
    if not req.messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    n = check_n(req.n)
    max_tokens = P.requested_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = P.requested_max_tokens(req.max_tokens, "max_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prompt_text = tok.render_chat(
        message_dicts(req.messages), tools=req.tools, chat_template=req.chat_template,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs)
    prompt_ids = P.truncate_prompt(tok.encode(prompt_text, add_special_tokens=False), req.truncate_prompt_tokens,
                                   info)
    max_tokens = P.check_prompt(prompt_ids, info, max_tokens, "messages")
    cfg = gw.config
    tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, cfg.tool_call_parser,
                      cfg.enable_auto_tool_choice, marker_literal(tok))
    spec = one_spec(("response_format", response_format_spec(req.response_format)),
                    ("structured_outputs", structured_outputs_spec(structured_outputs_of(req))),
                    ("tool_choice", tools.spec))
    spec = reasoning_aware(spec, cfg.reasoning_parser, prompt_text, marker_literal(tok))
    params = P.sampling_params(req, max_tokens, logprobs, info, spec, gw.sampling_defaults)
    # Formats whose markers are special tokens need them in the text to be parsed.
    skip_special = req.skip_special_tokens and not (tools.parser and tools.parser.special_markers)
    gen = Generation(gw.client, tok, [prompt_ids], params, n, P.stop_list(req.stop),
                     req.include_stop_str_in_output, skip_special, logprobs is not None,
                     req.cache_salt, app, req.priority)
    gen.start()
    rid = "chatcmpl-" + gen.id_base
    created = int(time.time())
    outputs = [ChatOutput(cfg.reasoning_parser, prompt_text, tools.parser) for _ in gen.choices]
    if not outputs[0].active:
        outputs = None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        deltas = await _primed(gen, cfg.sse_keepalive, wait_first=spec is not None)
        return SSEResponse(_chat_stream(gw, gen, rid, created, model, include_usage, deltas, outputs))
    if not await gen.collect(request.receive):
        return Response(status_code=499)  # nobody is listening; nginx's 'client closed request'
    choices = [
        t.ChatChoice(
            index=c.index,
            message=_message(c, outputs[c.index] if outputs else None),
            logprobs=t.ChatLogprobs(_chat_logprobs(tok, c.logprobs)) if logprobs is not None else None,
            finish_reason=c.finish_reason if outputs is None else outputs[c.index].final_reason,
        )
        for c in gen.choices
    ]
    return _json_response(t.ChatCompletion(id=rid, created=created, model=model, choices=choices,
                                           usage=_usage(gen)))


async def completions(request: Request) -> Response:
    gw: GatewayState = request.app.state.gw
    app = gw.check_auth(request)
    req = await _decode(request, t.CompletionRequest)
    _check_common(req)
    info, tok = gw.require_ready()
    model = gw.check_model(req.model)
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    n = check_n(req.n)
    if req.best_of is not None and req.best_of != n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise InvalidRequestError("logprobs must be in [0, 20]", param="logprobs")
    if req.echo and req.stream:
        raise InvalidRequestError("echo is not supported with stream=true", param="echo")
    # OpenAI's default for completions is 16 tokens.
    requested = P.requested_max_tokens(req.max_tokens, "max_tokens")
    prompts = [P.truncate_prompt(p, req.truncate_prompt_tokens, info)
               for p in P.completion_prompts(req.prompt, tok)]
    max_tokens = min(P.check_prompt(p, info, 16 if requested is None else requested, "prompt")
                     for p in prompts)
    spec = one_spec(("response_format", response_format_spec(req.response_format)),
                    ("structured_outputs", structured_outputs_spec(structured_outputs_of(req))))
    params = P.sampling_params(req, max_tokens, req.logprobs, info, spec, gw.sampling_defaults)
    gen = Generation(gw.client, tok, prompts, params, n, P.stop_list(req.stop),
                     req.include_stop_str_in_output, req.skip_special_tokens, req.logprobs is not None,
                     req.cache_salt, app, req.priority)
    gen.start()
    rid = "cmpl-" + gen.id_base
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        deltas = await _primed(gen, gw.config.sse_keepalive, wait_first=spec is not None)
        return SSEResponse(_completion_stream(gw, gen, rid, created, model, include_usage, req.logprobs,
                                              deltas))
    if not await gen.collect(request.receive):
        return Response(status_code=499)  # nobody is listening; nginx's 'client closed request'
    choices = []
    for c in gen.choices:
        text = c.text
        if req.echo:
            text = tok.decode(prompts[c.index // n], skip_special_tokens=req.skip_special_tokens) + text
        lp = _completion_logprobs(tok, c.logprobs, 0) if req.logprobs is not None else None
        choices.append(t.CompletionChoice(index=c.index, text=text, logprobs=lp,
                                          finish_reason=c.finish_reason))
    return _json_response(t.Completion(id=rid, created=created, model=model, choices=choices,
                                       usage=_usage(gen)))


def _message(choice, out: ChatOutput | None) -> t.AssistantMessage:
    if out is None:
        return t.AssistantMessage(content=choice.text)
    reasoning, content, calls = out.whole(choice.text)
    out.final_reason = finish_reason(choice.finish_reason, bool(calls))
    msg = t.AssistantMessage(content=content)
    if out.tool_parser is not None:
        msg.tool_calls = calls
    if out.reasoning is not None:
        msg.reasoning = msg.reasoning_content = reasoning
    return msg


async def _primed(gen: Generation, keepalive: float, wait_first: bool):
    """``gen.deltas()``, with the first delta already awaited when ``wait_first``.

    A constrained request's grammar may be refused by the engine; waiting for
    the first output before the response starts turns that refusal into a 400
    instead of an error event inside a 200 stream.
    """
    it = gen.deltas(keepalive=keepalive)
    head = []
    if wait_first:
        try:
            async for d in it:
                if d is not None:  # no keep-alives before the response starts
                    head.append(d)
                    break
        except BaseException:
            await it.aclose()
            raise

    async def chained():
        for d in head:
            yield d
        async for d in it:
            yield d

    return chained()


def _usage(gen: Generation) -> t.Usage:
    prompt, completion, cached = gen.usage_counts()
    return t.Usage(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=t.PromptTokensDetails(cached_tokens=cached))


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _chat_logprobs(tok, entries) -> list[t.TokenLogprob]:
    out = []
    for token_id, lp in entries:
        text = tok.token_text(token_id)
        tops = [t.TopLogprob(token=tok.token_text(i), logprob=v, bytes=_token_bytes(tok.token_text(i)))
                for i, v in zip(lp.top_ids, lp.top_logprobs)]
        out.append(t.TokenLogprob(token=text, logprob=lp.logprob, bytes=_token_bytes(text),
                                  top_logprobs=tops))
    return out


def _completion_logprobs(tok, entries, offset: int) -> t.CompletionLogprobs:
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, lp in entries:
        text = tok.token_text(token_id)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({tok.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)})
        offsets.append(offset)
        offset += len(text)
    return t.CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                                text_offset=offsets)


async def _chat_stream(gw: GatewayState, gen: Generation, rid: str, created: int, model: str,
                       include_usage: bool, deltas, outputs: list[ChatOutput] | None):
    usage_field = None if include_usage else msgspec.UNSET

    def chunk(choice: t.ChatChunkChoice) -> bytes:
        return event(t.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice],
                                           usage=usage_field))

    try:
        for c in gen.choices:
            yield chunk(t.ChatChunkChoice(index=c.index, delta=t.Delta(role="assistant", content="")))
        async for d in deltas:
            if d is None:
                yield KEEPALIVE
                continue
            lp = t.ChatLogprobs(_chat_logprobs(gw.tokenizer, d.logprobs)) if d.logprobs else None
            reason = d.finish_reason
            if outputs is None:
                delta = t.Delta(content=d.text)
                has = bool(d.text)
            else:
                out = outputs[d.index]
                reasoning, content, calls = out.feed(d.text, final=reason is not None)
                delta = t.Delta(content=content or None, reasoning=reasoning or None,
                                reasoning_content=reasoning or None)
                has = bool(content or reasoning)
                reason = finish_reason(reason, out.called_tools)
            if has or lp is not None:
                yield chunk(t.ChatChunkChoice(index=d.index, delta=delta, logprobs=lp))
            if outputs is not None:
                # One chunk per tool-call delta: a call's name, then its argument increments.
                for call in calls:
                    yield chunk(t.ChatChunkChoice(index=d.index, delta=t.Delta(tool_calls=[call])))
            if reason is not None:
                yield chunk(t.ChatChunkChoice(index=d.index, delta=t.Delta(), finish_reason=reason))
        if include_usage:
            yield event(t.ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                              usage=_usage(gen)))
        yield DONE
    except MlxdError as e:
        yield sse_error_event(e)
    finally:
        gen.abort_unfinished()


async def _completion_stream(gw: GatewayState, gen: Generation, rid: str, created: int, model: str,
                             include_usage: bool, logprobs: int | None, deltas):
    offsets = [0] * len(gen.choices)

    def chunk(choice: t.CompletionChoice) -> bytes:
        return event(t.Completion(id=rid, created=created, model=model, choices=[choice],
                                  usage=None if include_usage else msgspec.UNSET))

    try:
        async for d in deltas:
            if d is None:
                yield KEEPALIVE
                continue
            lp = None
            if logprobs is not None and d.logprobs:
                lp = _completion_logprobs(gw.tokenizer, d.logprobs, offsets[d.index])
                offsets[d.index] = lp.text_offset[-1] + len(lp.tokens[-1])
            if d.text or lp is not None or d.finish_reason is not None:
                yield chunk(t.CompletionChoice(index=d.index, text=d.text, logprobs=lp,
                                               finish_reason=d.finish_reason))
        if include_usage:
            yield event(t.Completion(id=rid, created=created, model=model, choices=[],
                                     usage=_usage(gen)))
        yield DONE
    except MlxdError as e:
        yield sse_error_event(e)
    finally:
        gen.abort_unfinished()
