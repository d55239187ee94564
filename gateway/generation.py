"""One HTTP request's generation: its choices fanned out as engine requests, their text assembled.

``n`` choices of each prompt become ``n`` engine requests (seeds seed, seed+1,
... when a seed is given). Each choice turns its token ids into text
(incrementally, UTF-8 safe), cuts it at the first stop string (aborting its
engine request there), and collects logprobs and token counts for usage.

The answer goes out as server-sent events (``SSEResponse``, ``event``).
Starlette's StreamingResponse only learns of a closed connection when a write
fails; a stream waiting on a long prefill would keep its engine request (and
its KV blocks) until then. ``SSEResponse`` watches the connection itself and
cancels the event source at once, whose ``finally`` aborts the requests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from gateway.detokenizer import IncrementalDetokenizer, StopMatcher
from shared.errors import MlxdError
from shared.protocol import Logprob, RequestOutput, SamplingParams


@dataclass
class ChoiceDelta:
    """What one engine output added to one choice."""

    index: int
    text: str
    # (token id, Logprob) for each token of this delta whose text is part of the output
    logprobs: list[tuple[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None


class Choice:
    __slots__ = ("index", "request_id", "detok", "stops", "num_prompt_tokens", "num_cached_tokens",
                 "num_completion_tokens", "finish_reason", "text_parts", "logprobs", "want_logprobs")

    def __init__(self, index: int, request_id: str, decode, prompt_ids: list[int],
                 stop: list[str], include_stop: bool, want_logprobs: bool):
        self.index = index
        self.request_id = request_id
        self.detok = IncrementalDetokenizer(decode, prompt_ids)
        self.stops = StopMatcher(stop, include_stop)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self.text_parts: list[str] = []
        self.logprobs: list[tuple[int, Logprob]] = []
        self.want_logprobs = want_logprobs

    def feed(self, out: RequestOutput) -> ChoiceDelta:
        ids = out.new_token_ids
        # The stop token counts as a completion token but is not text.
        text_ids = ids[:-1] if (out.stop_token_id is not None and ids and ids[-1] == out.stop_token_id
                                and out.finish_reason == "stop") else ids
        self.num_completion_tokens += len(ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        text = self.detok.add(text_ids)
        if out.finish_reason is not None:
            text += self.detok.flush()
        emit = self.stops.feed(text)
        if self.stops.stopped:
            self.finish_reason = "stop"
        elif out.finish_reason is not None:
            emit += self.stops.flush()
            self.finish_reason = out.finish_reason
        lps = []
        if self.want_logprobs and out.logprobs:
            lps = list(zip(text_ids, out.logprobs))
            self.logprobs.extend(lps)
        self.text_parts.append(emit)
        return ChoiceDelta(self.index, emit, lps, self.finish_reason)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Generation:
    """Fans prompts x n out to the engine and yields ChoiceDeltas as outputs arrive."""

    def __init__(self, client, tokenizer, prompts: list[list[int]], params: SamplingParams, n: int,
                 stop: list[str], include_stop: bool, skip_special_tokens: bool, want_logprobs: bool,
                 cache_salt: str | None = None, app: str | None = None, priority: int = 0,
                 lora_name: str | None = None):
        self.client = client
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.app = app
        self.priority = priority
        self.id_base = uuid.uuid4().hex
        self.prompts = prompts
        self.params = params
        self.n = n
        self.queue: asyncio.Queue = asyncio.Queue()
        decode = tokenizer.decoder(skip_special_tokens)
        self.choices = [
            Choice(i, f"{self.id_base}-{i}", decode, prompts[i // n], stop, include_stop, want_logprobs)
            for i in range(len(prompts) * n)
        ]

    def start(self) -> None:
        """Send every choice's request; on a refusal, withdraw those already sent."""
        try:
            for c in self.choices:
                params = self.params
                if params.seed is not None and c.index % self.n:
                    # Distinct but reproducible choices of one prompt.
                    params = _replace_seed(params, params.seed + c.index % self.n)
                self.client.add(c.request_id, self.prompts[c.index // self.n], params, self.queue, c.index,
                                self.cache_salt, self.app, self.priority,
                                (self.id_base, len(self.choices), self.n, c.index % self.n)
                                if len(self.choices) > 1 else None,
                                lora_name=self.lora_name)
        except BaseException:
            self.abort_unfinished()
            raise

    def abort_unfinished(self) -> None:
        ids = [c.request_id for c in self.choices if c.finish_reason is None]
        if ids:
            self.client.abort(ids)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def collect(self, receive, deltas: AsyncIterator | None = None) -> bool:
        """Run a non-streamed generation to its end, consuming ``deltas`` (default: ``self.deltas()``).

        Returns False when the client hung up first (ASGI ``receive`` saw the
        disconnect); the unfinished engine requests are aborted either way.
        """
        async def drain():
            async for _ in deltas if deltas is not None else self.deltas():
                pass

        try:
            return await unless_disconnected(drain(), receive)
        finally:
            self.abort_unfinished()

    async def deltas(self, keepalive: float | None = None):
        """Yield ChoiceDeltas until every choice finished; None after ``keepalive`` idle seconds.

        An engine error for any choice aborts the others and raises it.
        """
        try:
            while not self.done:
                try:
                    # Outputs already queued are taken without waiting: wait_for costs a
                    # task per call, which adds up at thousands of tokens per second.
                    index, item = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        if keepalive is None:
                            index, item = await self.queue.get()
                        else:
                            index, item = await asyncio.wait_for(self.queue.get(), keepalive)
                    except asyncio.TimeoutError:
                        yield None
                        continue
                if isinstance(item, MlxdError):
                    raise item
                choice = self.choices[index]
                if choice.finish_reason is not None:
                    continue  # stopped by a stop string; its engine request was aborted
                if item.finish_reason == "error":
                    raise MlxdError("the engine failed to generate this request")
                delta = choice.feed(item)
                if choice.finish_reason is not None and item.finish_reason is None:
                    self.client.abort([choice.request_id])
                yield delta
        finally:
            self.abort_unfinished()

    async def primed_deltas(self, keepalive: float, wait_first: bool):
        """``deltas(keepalive)``, with the first delta already awaited when ``wait_first``.

        A constrained request's grammar may be refused by the engine; waiting
        for the first output before the response starts turns that refusal
        into a 400 instead of an error event inside a 200 stream.
        """
        it = self.deltas(keepalive=keepalive)
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

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens) over the whole request."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.num_completion_tokens for c in self.choices)
        cached = sum(self.choices[i * self.n].num_cached_tokens for i in range(len(self.prompts)))
        return prompt, completion, cached


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, seed=seed)


# Server-sent events.

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"

_encoder = msgspec.json.Encoder()


def event(payload) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def named_event(name: str, payload) -> bytes:
    """An event with an ``event:`` line, as Anthropic's and the Responses API's streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


async def wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work, receive) -> bool:
    """Run the coroutine ``work`` until it ends or the client hangs up (ASGI ``receive`` sees the
    disconnect), whichever comes first; False if the client went first (``work`` is cancelled).
    ``work``'s own exception is raised."""
    task = asyncio.create_task(work)
    gone = asyncio.create_task(wait_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()
    return True


class SSEResponse:
    """``on_close`` runs when the response ends however it ends, also when the client left
    before the first event (an async generator closed unstarted never runs its ``finally``)."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_close: Callable[[], None] | None = None):
        self.events = events
        self.on_close = on_close
        self.headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
        ]

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.create_task(pump())
        watch_task = asyncio.create_task(wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_task, watch_task):
                t.cancel()
            await asyncio.gather(pump_task, watch_task, return_exceptions=True)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                self.on_close()
        if pump_task.done() and not pump_task.cancelled():
            exc = pump_task.exception()
            # A write to a connection that just closed is the client's leaving, not an error.
            if exc is not None and not isinstance(exc, OSError):
                raise exc
