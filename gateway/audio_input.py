"""The audio routes' input: OpenAI's multipart upload read and checked, and its file decoded.

The gateway decodes the file (PyAV: wav, mp3, flac, ogg, m4a/mp4, webm, ...) to 16 kHz mono float32
samples in a worker thread, and the engine receives samples only: the codec's work and its
failures stay beside the HTTP work of one request, never in the engine's step, and the wire
carries one plain format.
"""

from __future__ import annotations

import io
import os

import av
import numpy as np
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from mlxd.gateway.state import read_body
from mlxd.shared.errors import InvalidRequestError, RequestTooLargeError

SAMPLE_RATE = 16000
# OpenAI's limits: a 25 MB file; mlxd adds one on the decoded length, which bounds the samples
# the gateway holds and sends (30 min: 115 MB of float32).
MAX_FILE_BYTES = 25 << 20
MAX_SECONDS = 30 * 60
# The file extensions OpenAI's route accepts; a file named otherwise is refused before decoding.
EXTENSIONS = ("flac", "m4a", "mp3", "mp4", "mpeg", "mpga", "oga", "ogg", "wav", "webm")


async def read_form(request: Request) -> tuple[UploadFile, dict[str, list[str]]]:
    """The upload ``file`` and the text fields (each name's values, in order) of a multipart body;
    413 past MAX_FILE_BYTES, 400 for a body that is not such a form."""
    body = await read_body(request)
    if len(body) > MAX_FILE_BYTES + (1 << 20):
        raise RequestTooLargeError(f"the file is over {MAX_FILE_BYTES >> 20} MB", param="file")
    headers = Headers(scope=request.scope)
    if not headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequestError("send the audio as multipart/form-data with a `file` field", param="file")

    async def stream():
        yield body

    try:
        form = await MultiPartParser(headers, stream(), max_files=1, max_fields=64).parse()
    except MultiPartException as e:
        raise InvalidRequestError(f"the multipart body is malformed: {e.message}", param="file") from None
    upload, fields = None, {}
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            if name != "file":
                raise InvalidRequestError(f"unexpected file field `{name}`", param=name)
            upload = value
        else:
            fields.setdefault(name, []).append(value)
    if upload is None:
        raise InvalidRequestError("the `file` field is missing", param="file")
    return upload, fields


def decode_audio(data: bytes, filename: str | None) -> np.ndarray:
    """The file's first audio stream as 16 kHz mono float32 samples (runs in a worker thread)."""
    if not data:
        raise InvalidRequestError("the file is empty", param="file")
    if len(data) > MAX_FILE_BYTES:
        raise RequestTooLargeError(f"the file is over {MAX_FILE_BYTES >> 20} MB", param="file")
    ext = os.path.splitext(filename or "")[1].lstrip(".").lower()
    if ext and ext not in EXTENSIONS:
        raise InvalidRequestError(f"unsupported file format `{ext}`; supported: {', '.join(EXTENSIONS)}",
                                  param="file")
    chunks, total, limit = [], 0, MAX_SECONDS * SAMPLE_RATE
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise InvalidRequestError("the file holds no audio stream", param="file")
            stream = container.streams.audio[0]
            # 16-bit samples, as Whisper's own loaders make them: the same file gives the same text.
            resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().reshape(-1)
                    total += len(chunk)
                    if total > limit:
                        raise RequestTooLargeError(f"the audio is longer than {MAX_SECONDS // 60} minutes",
                                                   param="file")
                    chunks.append(chunk)
            chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    except (av.FFmpegError, ValueError, IndexError) as e:
        raise InvalidRequestError(f"the file could not be decoded as audio ({e})", param="file") from None
    samples = np.concatenate(chunks).astype(np.float32) / 32768.0 if chunks else np.zeros(0, np.float32)
    if not len(samples):
        raise InvalidRequestError("the file holds no audio samples", param="file")
    return samples
