"""Prefill-only engine requests for the pooling routes: inputs as token ids out, results in.

Every input of one HTTP request becomes one engine request of the route's
task, sent as one group (the engine admits all or none of them). The engine
answers each with its final output: a float32 vector (embed) or a
probability (score). A client that hangs up aborts what is still running; one
that hangs up while its inputs wait for a worker thread to tokenize them is
never sent (the routes tokenize under ``while_connected``).
"""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
from starlette.requests import Request

from mlxd.gateway import params as P
from mlxd.gateway.generation import unless_disconnected
from mlxd.gateway.state import GatewayState
from mlxd.shared.errors import ContextLengthError, InvalidRequestError, MlxdError
from mlxd.shared.protocol import EngineInfo, RequestOutput, SamplingParams

# Inputs one HTTP request may carry: each is an engine request and a place in its waiting queue
# (which refuses, with 429, a request larger than it).
MAX_INPUTS = 2048

def input_ids(value, tok, info: EngineInfo, param: str, add_special_tokens: bool = True,
              truncate: int | None = None) -> list[list[int]]:
    """An ``input`` (string, strings, token ids, lists of them) as checked token ids; tokenizes (off the loop)."""
    def encode(text: str) -> list[int]:
        P.check_prompt_bytes(text, info, tok.max_token_bytes, param)
        return tok.encode(text, add_special_tokens=add_special_tokens)

    if isinstance(value, str):
        prompts = [encode(value)]
    elif not value:
        raise InvalidRequestError(f"{param} is empty", param=param)
    elif len(value) > MAX_INPUTS:
        raise InvalidRequestError(f"at most {MAX_INPUTS} inputs per request; this one has {len(value)}",
                                  param=param)
    elif all(isinstance(x, str) for x in value):
        prompts = [encode(x) for x in value]
    elif all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        prompts = [list(value)]
    elif all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
             for x in value):
        prompts = [list(x) for x in value]
    else:
        raise InvalidRequestError(f"{param} must be a string, a list of strings, a list of token ids, or a "
                                  "list of lists of token ids", param=param)
    prompts = [P.truncate_prompt(p, truncate, info) for p in prompts]
    for ids in prompts:
        check_ids(ids, info, param)
    return prompts


def check_ids(ids: list[int], info: EngineInfo, param: str) -> None:
    """A pooled prompt may fill the whole context (nothing is generated after it)."""
    if not ids:
        raise InvalidRequestError(f"{param} holds an empty input", param=param)
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        raise InvalidRequestError(f"token ids must be in [0, {info.vocab_size})", param=param)
    if len(ids) > info.max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {info.max_model_len} tokens; {param} holds an input of "
            f"{len(ids)} tokens (truncate_prompt_tokens cuts inputs to fit).", param=param,
            prompt_tokens=len(ids), max_model_len=info.max_model_len)


async def run_pooled(gw: GatewayState, request: Request, prompts: list[list[int]], task: str, app: str | None,
                     priority: int, param: str) -> list[RequestOutput] | None:
    """Each prompt's final RequestOutput, in order; None when the client hung up first.

    An engine refusal (a full queue, a prompt the pool cannot hold) raises,
    naming ``param``; the requests still running are aborted either way.
    """
    client = gw.client
    base = uuid.uuid4().hex
    ids = [f"{task}-{base}-{i}" for i in range(len(prompts))]
    queue: asyncio.Queue = asyncio.Queue()
    results: list[RequestOutput | None] = [None] * len(prompts)
    # Each input is a prompt of its own (n = 1, choice 0).
    group = (base, len(prompts), 1, 0) if len(prompts) > 1 else None
    params = SamplingParams(max_tokens=1)

    async def collect():
        left = len(prompts)
        while left:
            index, item = await queue.get()
            if isinstance(item, MlxdError):
                if isinstance(item, ContextLengthError):
                    item.param = param
                raise item
            if item.finish_reason is None:
                continue
            if item.finish_reason != "stop":
                raise MlxdError(f"the engine ended this request ({item.finish_reason})")
            results[index] = item
            left -= 1

    try:
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            client.add(rid, prompt, params, queue, i, None, app, P.check_priority(priority), group, task)
        return results if await unless_disconnected(collect(), request.receive) else None
    finally:
        client.abort([rid for rid, r in zip(ids, results) if r is None])


def vectors(outputs: list[RequestOutput]) -> np.ndarray:
    """The outputs' vectors as one ``[n, dim]`` float32 array."""
    return np.stack([np.frombuffer(o.embedding, dtype="<f4") for o in outputs])
