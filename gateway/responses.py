"""OpenAI's Responses API, stateless: POST /v1/responses over the chat path.

``input`` (a string, or message / function_call / function_call_output items)
and ``instructions`` become chat messages, function tools become chat tools,
``text.format`` becomes response_format; ChatRun generates. The answer is a
list of output items (reasoning, message with output_text, function_call),
whole or as the Responses event stream. Nothing is stored: ``store`` and
``previous_response_id`` are refused with a 400 that says so.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from mlxd.gateway.chat_run import ChatInput, ChatRun
from mlxd.gateway.errors import error_body, to_mlxd_error
from mlxd.gateway.generation import KEEPALIVE, SSEResponse, named_event
from mlxd.gateway.params import loads
from mlxd.gateway.responses_tools import ResponsesTools, responses_tools
from mlxd.gateway.state import open_request
from mlxd.shared.errors import InvalidRequestError, MlxdError


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    text: dict[str, Any] | None = None
    # Effort settings are accepted; a model that reasons does so by its template.
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


# -- request → ChatInput ----------------------------------------------------------------

_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content, where: str) -> str | list[dict]:
    """Text parts joined; with an ``input_image`` among them, the parts in order for the template
    (``{"type": "image", "url": ...}``, which gateway.media reads)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError("content must be a string or a list of text parts", param=where)
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image", "url": part["image_url"]})
        else:
            raise InvalidRequestError(f"only text and input_image content parts are supported (got {kind!r})",
                                      param=f"{where}[{j}]")
    return parts if len(parts) > len(texts) else "\n".join(texts)


def _arguments(text: str, where: str) -> dict:
    """A call's arguments as the object templates render (as the chat path gives them)."""
    value = loads(text, param=where) if text.strip() else {}
    if not isinstance(value, dict):
        raise InvalidRequestError("function_call arguments must be a JSON object", param=where)
    return value


def _messages(req: ResponsesRequest, tools: ResponsesTools) -> list[dict]:
    out: list[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    for i, item in enumerate(req.input):
        at = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"unknown role {role!r}", param=f"{at}.role")
            # Chat templates know no developer role: its instructions are a system turn.
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise InvalidRequestError("a function_call item needs call_id, name and arguments", param=at)
            args = _arguments(item["arguments"], f"{at}.arguments")
            # The model's own earlier call, under the name it knows the tool by.
            name = tools.flat_name(item["name"], item.get("namespace"))
            call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": args}}
            # Calls made in one turn belong to one assistant message.
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequestError("a function_call_output item needs a call_id", param=at)
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output", ""), f"{at}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning is not replayed, as chat templates drop it
        elif kind == "item_reference":
            raise InvalidRequestError("item references need stored responses, which this server does not keep",
                                      param=at)
        else:
            raise InvalidRequestError(f"unsupported input item type {kind!r}", param=at)
    return out


def _tool_choice(tc, tools: ResponsesTools):
    if tc is None or isinstance(tc, str):
        return tc
    if tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tools.flat_name(tc["name"], tc.get("namespace"))}}
    raise InvalidRequestError('tool_choice is "auto", "none", "required" or {"type": "function", "name": ...}',
                              param="tool_choice")


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return fmt  # text and json_object are chat's own


def chat_input(req: ResponsesRequest, tools: ResponsesTools) -> ChatInput:
    return ChatInput(_messages(req, tools), tools=tools.chat or None,
                     tool_choice=_tool_choice(req.tool_choice, tools),
                     parallel_tool_calls=req.parallel_tool_calls, max_tokens=req.max_output_tokens,
                     temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                     response_format=_response_format(req.text), param="input",
                     max_tokens_param="max_output_tokens")


# -- route ------------------------------------------------------------------------------

async def responses(request: Request) -> Response:
    gw, app, req, model = await open_request(request, ResponsesRequest)
    if req.previous_response_id is not None:
        raise InvalidRequestError("previous_response_id needs stored responses, which this stateless server "
                                  "does not keep; send the whole conversation as input", param="previous_response_id")
    if req.store:
        raise InvalidRequestError("this server does not store responses; send store=false", param="store")
    tools = responses_tools(req.tools)
    inp = chat_input(req, tools)
    inp.app = app
    inp.lora_name = gw.lora_name(model)
    run = ChatRun(gw, inp, request.receive)
    await run.start()
    shell = _Shell("resp_" + run.id, model, req, tools)
    if req.stream:
        return SSEResponse(_stream(run, shell), on_close=run.gen.abort_unfinished)
    if not await run.collect():
        return Response(status_code=499)  # nobody is listening
    reasoning, content, calls = run.whole()
    parts: list[tuple[str, object]] = []
    if reasoning:
        parts.append(("rs", reasoning))
    if content:
        parts.append(("msg", content))
    parts += [("fc", c) for c in calls]
    items = []
    for n, (kind, value) in enumerate(parts):
        iid = _item_id(kind, run, n)
        last = n == len(parts) - 1
        if kind == "rs":
            items.append(_reasoning_item(iid, value, _status(run, last)))
        elif kind == "msg":
            items.append(_message_item(iid, value, _status(run, last)))
        else:
            f = value["function"]
            items.append(shell.call_item(iid, value["id"], f["name"], f["arguments"],
                                         _status(run, last, f["arguments"])))
    return Response(msgspec.json.encode(shell.body(run, items)), media_type="application/json")


def _status(run: ChatRun, last: bool, arguments: str | None = None) -> str:
    """An item's status: the one the token limit cut is incomplete, and so is a call whose
    arguments are not a JSON object (a client must not run it)."""
    if last and run.finish_reason == "length":
        return "incomplete"
    if arguments is not None and not _is_json_object(arguments):
        return "incomplete"
    return "completed"


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(msgspec.json.decode(text), dict)
    except (msgspec.DecodeError, RecursionError):
        return False


def _item_id(prefix: str, run: ChatRun, n: int) -> str:
    return f"{prefix}_{run.id}{n}"


def _reasoning_item(iid: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": iid, "summary": [], "content": content, "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(iid: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": iid, "role": "assistant", "status": status, "content": content}


class _Shell:
    """The response object around the output: the request's settings echoed, status and usage."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, tools: ResponsesTools):
        self.rid, self.model, self.req, self.tools = rid, model, req, tools
        self.created = int(time.time())

    def call_item(self, iid: str, call_id: str, flat_name: str, arguments: str, status: str) -> dict:
        """A function_call item under the name (and namespace) the client declared the tool by."""
        name, namespace = self.tools.client_name(flat_name)
        item = {"type": "function_call", "id": iid, "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def body(self, run: ChatRun | None, output: list[dict], status: str | None = None) -> dict:
        req = self.req
        incomplete = None
        usage = None
        if run is not None:
            if run.finish_reason == "length":
                incomplete = {"reason": "max_output_tokens"}
            prompt, completion, cached = run.usage()
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + completion}
        if status is None:
            status = "incomplete" if incomplete else "completed"
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": incomplete, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False, "text": {"format": fmt},
                "reasoning": req.reasoning, "previous_response_id": None, "store": False,
                "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user}


async def _stream(run: ChatRun, shell: _Shell):
    """The Responses event sequence; each output item opens with output_item.added and closes with .done."""
    seq = 0

    def ev(kind: str, **fields) -> bytes:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return named_event(kind, payload)

    items: list[dict] = []  # finished items, in output order
    cur: dict | None = None  # the open item: {"kind", "id", "text" | call fields}
    calls: dict[int, dict] = {}  # the parser's call index → its open item

    def close(last: bool = False) -> list[bytes]:
        nonlocal cur
        if cur is None:
            return []
        out, i, iid = [], cur["index"], cur["id"]
        if cur["kind"] == "reasoning":
            item = _reasoning_item(iid, cur["text"], _status(run, last))
            out.append(ev("response.reasoning_text.done", item_id=iid, output_index=i, content_index=0,
                          text=cur["text"]))
        elif cur["kind"] == "message":
            item = _message_item(iid, cur["text"], _status(run, last))
            out.append(ev("response.output_text.done", item_id=iid, output_index=i, content_index=0,
                          text=cur["text"], logprobs=[]))
            out.append(ev("response.content_part.done", item_id=iid, output_index=i, content_index=0,
                          part=_text_part(cur["text"])))
        else:
            item = shell.call_item(iid, cur["call_id"], cur["name"], cur["text"],
                                   _status(run, last, cur["text"]))
            out.append(ev("response.function_call_arguments.done", item_id=iid, output_index=i,
                          arguments=cur["text"]))
        out.append(ev("response.output_item.done", output_index=i, item=item))
        items.append(item)
        cur = None
        return out

    def open_item(kind: str, prefix: str, **extra) -> list[bytes]:
        nonlocal cur
        out = close()
        i = len(items)
        cur = {"kind": kind, "id": _item_id(prefix, run, i), "index": i, "text": "", **extra}
        if kind == "reasoning":
            out.append(ev("response.output_item.added", output_index=i,
                          item=_reasoning_item(cur["id"], None, "in_progress")))
        elif kind == "message":
            out.append(ev("response.output_item.added", output_index=i,
                          item=_message_item(cur["id"], None, "in_progress")))
            out.append(ev("response.content_part.added", item_id=cur["id"], output_index=i, content_index=0,
                          part=_text_part("")))
        else:
            out.append(ev("response.output_item.added", output_index=i,
                          item=shell.call_item(cur["id"], extra["call_id"], extra["name"], "", "in_progress")))
        return out

    try:
        yield ev("response.created", response=shell.body(None, [], "in_progress"))
        yield ev("response.in_progress", response=shell.body(None, [], "in_progress"))
        async for p in run.pieces():
            if p is None:
                yield KEEPALIVE
                continue
            out: list[bytes] = []
            if p.reasoning:
                if cur is None or cur["kind"] != "reasoning":
                    out += open_item("reasoning", "rs")
                cur["text"] += p.reasoning
                out.append(ev("response.reasoning_text.delta", item_id=cur["id"], output_index=cur["index"],
                              content_index=0, delta=p.reasoning))
            if p.content:
                if cur is None or cur["kind"] != "message":
                    out += open_item("message", "msg")
                cur["text"] += p.content
                out.append(ev("response.output_text.delta", item_id=cur["id"], output_index=cur["index"],
                              content_index=0, delta=p.content, logprobs=[]))
            for c in p.calls:
                f = c.get("function", {})
                if "id" in c:
                    out += open_item("call", "fc", call_id=c["id"], name=f["name"])
                    calls[c["index"]] = cur
                args = f.get("arguments") or ""
                if args and cur is calls.get(c["index"]):
                    cur["text"] += args
                    out.append(ev("response.function_call_arguments.delta", item_id=cur["id"],
                                  output_index=cur["index"], delta=args))
            for b in out:
                yield b
        for b in close(last=True):
            yield b
        body = shell.body(run, items)
        yield ev("response." + body["status"], response=body)
    except MlxdError as e:
        _, err = error_body(to_mlxd_error(e))
        yield ev("error", code=err["error"]["code"], message=err["error"]["message"], param=err["error"]["param"])
