"""One HTTP request's generation: its choices fanned out as engine requests, their text assembled.

``n`` choices of each prompt become ``n`` engine requests (seeds seed, seed+1,
... when a seed is given). Each choice turns its token ids into text
(incrementally, UTF-8 safe), cuts it at the first stop string (aborting its
engine request there), and collects logprobs and token counts for usage.

Decoding: a token of a byte-level vocabulary may carry only part of a UTF-8
character (an emoji is often three tokens). Decoding the new tokens alone
would emit U+FFFD for each part. Instead each step decodes a short window of
recent tokens twice, with and without the new ones, and emits the difference
only once it no longer ends in an incomplete character. The window starts a
few tokens back so that tokenizers that strip a leading space at the start of
a decode (SentencePiece) still produce the space.

Stop strings are found across token boundaries and never emitted: text that
could still turn out to be the start of a stop string is held back until the
next tokens either complete the stop string (the request ends there) or rule
it out (the text is released).

The answer goes out as server-sent events (``SSEResponse``, ``event``).
Starlette's StreamingResponse only learns of a closed connection when a write
fails; a stream waiting on a long prefill would keep its engine request (and
its KV blocks) until then. ``SSEResponse`` watches the connection itself and
cancels the event source at once, whose ``finally`` aborts the requests.
Before the answer begins, ``while_connected`` watches it the same way over the
work that prepares it (a prompt waiting for a worker thread to tokenize it, a
constrained request's wait for its first output): a client that leaves then is
never sent to the engine, or is aborted at once.

Over 400 lines because a generation's requests, their outputs' queue, the stream and the
client's connection end together, and each ending must abort the others.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from mlxd.shared.errors import ClientGoneError, MlxdError
from mlxd.shared.protocol import Logprob, RequestOutput, SamplingParams


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
                 lora_name: str | None = None, images: list | None = None):
        self.client = client
        self.lora_name = lora_name
        self.images = images  # the prompt's (one prompt only: chat)
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
                                lora_name=self.lora_name, images=self.images)
        except BaseException:
            self.abort_unfinished()
            raise

    def abort_unfinished(self) -> None:
        ids = [c.request_id for c in self.choices if c.finish_reason is None]
        if ids:
            self.client.abort(ids)

    def end_choice(self, index: int) -> None:
        """End a choice before the engine did, its answer complete (a tool-call list that repeated a
        call): its engine request is aborted and it finishes with ``stop``, as at a stop string."""
        c = self.choices[index]
        if c.finish_reason is None:
            c.finish_reason = "stop"
            self.client.abort([c.request_id])

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
    return msgspec.structs.replace(params, seed=seed)


# Token ids to text (see the module docstring): decoded a step at a time, cut at stop strings.

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context for the first generated token.
_CONTEXT = 6


class IncrementalDetokenizer:
    """Feed token ids as they come; get the text they complete.

    ``decode(ids) -> str`` is the tokenizer's own decode (special tokens
    skipped or not, as the request asked); the concatenation of everything
    ``add`` and ``flush`` return equals ``decode(all generated ids)`` for the
    tokenizers mlxd serves.
    """

    __slots__ = ("_decode", "_tokens", "_prefix", "_read")

    def __init__(self, decode, prompt_ids: list[int] | None = None):
        self._decode = decode
        self._tokens = list(prompt_ids[-_CONTEXT:]) if prompt_ids else []
        self._prefix = 0  # start of the decode window
        self._read = len(self._tokens)  # tokens before this are already emitted

    def add(self, ids: list[int]) -> str:
        if not ids:
            return ""
        self._tokens.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        tokens = self._tokens
        if self._read == len(tokens):
            return ""
        before = self._decode(tokens[self._prefix:self._read])
        after = self._decode(tokens[self._prefix:])
        if not final and (len(after) <= len(before) or after.endswith(_REPLACEMENT)):
            return ""
        # `after` normally extends `before`; where a tokenizer rewrites the
        # seam, the common prefix is what was already emitted.
        if after.startswith(before):
            delta = after[len(before):]
        else:
            common = 0
            for a, b in zip(before, after):
                if a != b:
                    break
                common += 1
            delta = after[common:]
        self._prefix = self._read
        self._read = len(tokens)
        return delta


class StopMatcher:
    """Feed text as it is decoded; get the part that is safe to emit (held back while it may still
    begin a stop string, cut where one completes)."""

    __slots__ = ("stops", "include", "_held", "stopped", "matched")

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include_stop
        self._held = ""
        self.stopped = False
        # The stop string that ended the text (APIs that report which one, like Anthropic's).
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """The part of the text so far that is safe to emit; sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # The stop string completed first wins, as if text arrived a character at a
        # time (generation would have ended there); at equal ends, the longest.
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[0]):
                best = ((i + len(s), i), s)
        if best is not None:
            (_, i), s = best
            self.stopped = True
            self.matched = s
            self._held = ""
            return buf[: i + len(s)] if self.include else buf[:i]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, once generation ended without completing a stop string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = min(len(buf), max(len(s) for s in self.stops) - 1)
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


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


async def while_connected(work, receive):
    """The result of the coroutine ``work``, unless the client hangs up first (ASGI ``receive`` sees
    the disconnect): then ``work`` is cancelled and ClientGoneError raised. ``work``'s own exception
    is raised.

    Whatever ``work`` awaits is cancelled with it: a job queued for a worker thread
    (``asyncio.to_thread``) is then dropped before it runs, so that under load a prompt whose client
    left while it waited for a thread is neither tokenized nor sent."""
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
        raise ClientGoneError("the client closed the connection")
    return task.result()


async def unless_disconnected(work, receive) -> bool:
    """``while_connected``, as whether ``work`` ran to its end (False: the client went first)."""
    try:
        await while_connected(work, receive)
    except ClientGoneError:
        return False
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
