"""POST /v1/chat/completions: an OpenAI chat request as a ChatInput, its ChatRun's choices as OpenAI's answer."""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway import openai_types as t
from gateway import params as P
from gateway.chat_run import ChatInput, ChatRun, finish_reason
from gateway.errors import sse_error_event
from gateway.generation import DONE, KEEPALIVE, SSEResponse, event
from gateway.state import GatewayState, open_request
from gateway.tokenizer import message_dicts
from shared.errors import MlxdError


def chat_input(req: t.ChatCompletionRequest, app: str | None) -> ChatInput:
    P.check_stream_options(req)
    P.refuse_unsupported(req)
    max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
    return ChatInput(
        message_dicts(req.messages), tools=req.tools, tool_choice=req.tool_choice,
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
    run = ChatRun(gw, inp)
    await run.start()
    rid = "chatcmpl-" + run.id
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_stream(gw, run, rid, created, model, include_usage),
                           on_close=run.gen.abort_unfinished)
    if not await run.collect(request):
        return Response(status_code=499)  # nobody is listening; nginx's 'client closed request'
    choices = []
    for c in run.choices:
        message, reason = _message(run, c)
        lps = t.ChatLogprobs(chat_logprobs(gw.tokenizer, c.logprobs)) if run.inp.logprobs is not None else None
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


def chat_logprobs(tok, entries) -> list[t.TokenLogprob]:
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
            lp = t.ChatLogprobs(chat_logprobs(gw.tokenizer, p.logprobs)) if p.logprobs else None
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
