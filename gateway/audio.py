"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's speech-to-text routes.

The upload is decoded here (``audio_input``), sent to the engine as samples with the request's
options (``AudioInput``), and the engine's segments come back as each 30-second window is
decided: gathered into the ``response_format`` asked for (``audio_formats``), or, with
``stream=true``, sent as each arrives (``transcript.text.delta`` events, then
``transcript.text.done``). Only a Whisper model serves these routes (``check_task``).
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from mlxd.gateway import params as P
from mlxd.gateway.audio_formats import FORMATS, full_text, render
from mlxd.gateway.audio_input import SAMPLE_RATE, decode_audio, read_form
from mlxd.gateway.errors import sse_error_event
from mlxd.gateway.generation import SSEResponse, event, unless_disconnected, while_connected
from mlxd.gateway.state import GatewayState
from mlxd.shared.errors import InvalidRequestError, MlxdError
from mlxd.shared.protocol import AudioInput, SamplingParams, Segment

# Whisper's fallback temperatures: with temperature 0 (OpenAI's default) a window whose text looks
# wrong is decoded again at the next one.
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
GRANULARITIES = ("segment", "word")


@dataclass
class AudioOptions:
    model: str | None
    language: str | None
    prompt: str
    response_format: str
    temperature: float
    stream: bool


def _one(fields: dict[str, list[str]], name: str, default: str | None = None) -> str | None:
    values = fields.get(name)
    if not values:
        return default
    if len(values) > 1:
        raise InvalidRequestError(f"`{name}` is given {len(values)} times", param=name)
    return values[0]


def parse_options(fields: dict[str, list[str]], translate: bool) -> AudioOptions:
    fmt = _one(fields, "response_format", "json")
    if fmt not in FORMATS:
        raise InvalidRequestError(f"response_format must be one of {', '.join(FORMATS)}", param="response_format")
    try:
        temperature = float(_one(fields, "temperature", "0"))
    except ValueError:
        raise InvalidRequestError("temperature must be a number", param="temperature") from None
    if not 0.0 <= temperature <= 1.0:
        raise InvalidRequestError("temperature must be in [0, 1]", param="temperature")
    stream = (_one(fields, "stream", "false") or "").lower()
    if stream not in ("true", "false"):
        raise InvalidRequestError("stream must be true or false", param="stream")
    granularities = fields.get("timestamp_granularities[]", []) + fields.get("timestamp_granularities", [])
    for g in granularities:
        if g not in GRANULARITIES:
            raise InvalidRequestError(f"timestamp_granularities must be among {', '.join(GRANULARITIES)}",
                                      param="timestamp_granularities[]")
    if granularities and fmt != "verbose_json":
        raise InvalidRequestError("timestamp_granularities needs response_format verbose_json",
                                  param="timestamp_granularities[]")
    if "word" in granularities:
        raise InvalidRequestError("word timestamps are not supported; segment timestamps are",
                                  param="timestamp_granularities[]")
    if stream == "true" and (translate or fmt not in ("json", "text")):
        raise InvalidRequestError("stream is supported for transcriptions in the json and text formats",
                                  param="stream")
    language = _one(fields, "language")
    return AudioOptions(model=_one(fields, "model"), language=language.lower() if language else None,
                        prompt=_one(fields, "prompt", "") or "", response_format=fmt, temperature=temperature,
                        stream=stream == "true")


async def transcriptions(request: Request) -> Response:
    return await _speech_to_text(request, translate=False)


async def translations(request: Request) -> Response:
    return await _speech_to_text(request, translate=True)


async def _speech_to_text(request: Request, translate: bool):
    app = request.app.state.gw.check_auth(request)
    upload, fields = await read_form(request)
    opts = parse_options(fields, translate)
    gw: GatewayState = await request.app.state.gw.engine_for(opts.model, app)
    info, tok = gw.require_ready()
    gw.check_model(opts.model, app)
    P.check_task(info, "transcribe")
    data = await upload.read()
    samples = await while_connected(asyncio.to_thread(decode_audio, data, upload.filename), request.receive)
    prompt_ids = tok.encode(" " + opts.prompt.strip(), add_special_tokens=False) if opts.prompt.strip() else []
    audio = AudioInput(samples=samples.astype("<f4").tobytes(), language=None if translate else opts.language,
                       translate=translate, seed=secrets.randbits(63),
                       temperatures=list(FALLBACK_TEMPERATURES) if opts.temperature == 0 else [opts.temperature])
    duration = len(samples) / SAMPLE_RATE
    run = _Run(gw, prompt_ids, audio, app)
    if opts.stream:
        return SSEResponse(_events(run), on_close=run.abort)
    try:
        if not await unless_disconnected(run.collect(), request.receive):
            return Response(status_code=499)  # nobody is listening
    finally:
        run.abort()
    body, media = render(opts.response_format, run.segments, "translate" if translate else "transcribe",
                         run.language or opts.language or "en", duration)
    return Response(body, media_type=media)


class _Run:
    """One transcription in the engine: its segments as they arrive."""

    def __init__(self, gw: GatewayState, prompt_ids: list[int], audio: AudioInput, app: str | None):
        self.client = gw.client
        self.rid = f"transcribe-{uuid.uuid4().hex}"
        self.queue: asyncio.Queue = asyncio.Queue()
        self.segments: list[Segment] = []
        self.language: str | None = None
        self.finished = False
        self.client.add(self.rid, prompt_ids, SamplingParams(max_tokens=1), self.queue, app=app,
                        task="transcribe", audio=audio)

    async def next(self) -> list[Segment] | None:
        """The segments of the engine's next output; None once the transcription has ended."""
        if self.finished:
            return None
        _, item = await self.queue.get()
        if isinstance(item, MlxdError):
            self.finished = True
            raise item
        new = item.segments or []
        self.segments += new
        if item.finish_reason is not None:
            self.finished = True
            if item.finish_reason != "stop":
                raise MlxdError(f"the engine ended this transcription ({item.finish_reason})")
            self.language = item.language
        return new

    async def collect(self) -> None:
        while await self.next() is not None:
            pass

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.client.abort([self.rid])


async def _events(run: _Run):
    first = True
    try:
        while (new := await run.next()) is not None:
            delta = "".join(s.text for s in new)
            if first:
                delta = delta.lstrip()
            if delta:
                first = False
                yield event({"type": "transcript.text.delta", "delta": delta})
        yield event({"type": "transcript.text.done", "text": full_text(run.segments)})
    except MlxdError as e:
        yield sse_error_event(e)

