"""POST /v1/completions: prompts (text or token ids) in, their continuations out, whole or streamed."""

from __future__ import annotations

import asyncio
import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from mlxd.gateway import openai_types as t
from mlxd.gateway import params as P
from mlxd.gateway.errors import sse_error_event
from mlxd.gateway.generation import DONE, KEEPALIVE, Generation, SSEResponse, event, while_connected
from mlxd.gateway.state import GatewayState, decode_body
from mlxd.gateway.structured import one_spec, response_format_spec, structured_outputs_spec
from mlxd.shared.errors import MlxdError

# OpenAI's default for completions.
DEFAULT_MAX_TOKENS = 16


async def completions(request: Request) -> Response:
    app = request.app.state.gw.check_auth(request)
    req = await decode_body(request, t.CompletionRequest)
    P.check_stream_options(req)
    P.refuse_unsupported(req)
    gw: GatewayState = await request.app.state.gw.engine_for(req.model, app)
    info, tok = gw.require_ready()
    model = gw.check_model(req.model, app)
    P.check_task(info, "generate")
    n = P.check_n(req.n)
    P.check_completion(req, n)
    stops = P.stop_list(req.stop)
    requested = P.requested_max_tokens(req.max_tokens, "max_tokens")
    P.check_choices(P.num_prompts(req.prompt), n)
    # A client that leaves while its prompts wait for a worker thread is never sent (ClientGoneError).
    encoded = await while_connected(asyncio.to_thread(P.completion_prompts, req.prompt, tok, info), request.receive)
    prompts = [P.truncate_prompt(p, req.truncate_prompt_tokens, info) for p in encoded]
    max_tokens = min(P.check_prompt(p, info, DEFAULT_MAX_TOKENS if requested is None else requested, "prompt")
                     for p in prompts)
    spec = one_spec(("response_format", response_format_spec(req.response_format)),
                    ("structured_outputs", structured_outputs_spec(P.structured_outputs_of(req))))
    params = P.sampling_params(req, max_tokens, req.logprobs, info.vocab_size, n, spec, gw.sampling_defaults)
    gen = Generation(gw.client, tok, prompts, params, n, stops, req.include_stop_str_in_output,
                     req.skip_special_tokens, req.logprobs is not None, req.cache_salt, app, req.priority,
                     gw.lora_name(model))
    gen.start()
    rid = "cmpl-" + gen.id_base
    created = int(time.time())
    given = "max_tokens" if requested is not None else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            deltas = await while_connected(gen.primed_deltas(gw.config.sse_keepalive, wait_first=spec is not None),
                                           request.receive)
        except MlxdError as e:
            raise P.engine_error(e, "prompt", given) from None
        return SSEResponse(_stream(gw, gen, rid, created, model, include_usage, req.logprobs, deltas, given),
                           on_close=gen.abort_unfinished)
    try:
        if not await gen.collect(request.receive):
            return Response(status_code=499)  # nobody is listening; nginx's 'client closed request'
    except MlxdError as e:
        raise P.engine_error(e, "prompt", given) from None
    choices = []
    for c in gen.choices:
        text = c.text
        if req.echo:
            text = tok.decode(prompts[c.index // n], skip_special_tokens=req.skip_special_tokens) + text
        lp = _logprobs(tok, c.logprobs, 0) if req.logprobs is not None else None
        choices.append(t.CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=c.finish_reason))
    body = t.Completion(id=rid, created=created, model=model, choices=choices, usage=t.usage(gen.usage_counts()))
    return Response(msgspec.json.encode(body), media_type="application/json")


def _logprobs(tok, entries, offset: int) -> t.CompletionLogprobs:
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, lp in entries:
        text = tok.token_text(token_id)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({tok.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)})
        offsets.append(offset)
        offset += len(text)
    return t.CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)


async def _stream(gw: GatewayState, gen: Generation, rid: str, created: int, model: str, include_usage: bool,
                  logprobs: int | None, deltas, given: str | None):
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
                lp = _logprobs(gw.tokenizer, d.logprobs, offsets[d.index])
                offsets[d.index] = lp.text_offset[-1] + len(lp.tokens[-1])
            if d.text or lp is not None or d.finish_reason is not None:
                yield chunk(t.CompletionChoice(index=d.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason))
        if include_usage:
            yield event(t.Completion(id=rid, created=created, model=model, choices=[],
                                     usage=t.usage(gen.usage_counts())))
        yield DONE
    except MlxdError as e:
        yield sse_error_event(P.engine_error(e, "prompt", given))
    finally:
        gen.abort_unfinished()
