"""The wire between gateways and the engine: msgspec Structs encoded with msgpack.

A frame from a gateway is ``[kind, payload]``; the engine's ROUTER socket
prepends the gateway's identity, and the engine answers ``[identity, kind,
payload]``. ``kind`` is one byte (the ``Kind`` values below); ``payload`` is
one of the Structs below, msgpack-encoded. Nothing is pickled.

Hot-path structs travel as arrays (``array_like=True``): their fields may only
be appended, never reordered or removed. Any change that an older peer could
misread bumps ``PROTOCOL_VERSION``; the handshake refuses a mismatch.

A request's sampling parameters (``SamplingParams``, with its output
constraint ``StructuredSpec``) are part of the wire: the gateway builds them,
``AddRequest`` carries them, and the engine applies them; both ends check
their ranges with the one ``SamplingParams.validate``.

Over 400 lines because every message of the wire is declared here, beside its kind and the version
history, so that a change to any of them is read against all the others.
"""

from __future__ import annotations

import enum

import msgspec

from mlxd.shared.errors import InvalidRequestError

# 2: AddRequest gained app and priority.
# 3: AddRequest gained group and group_size.
# 4: AddRequest gained n and choice.
# 5: AddRequest gained task; RequestOutput gained embedding and score; ModelInfo gained tasks,
#    embedding_dim and matryoshka_dimensions.
# 6: LoRA: AddRequest.lora_name, ModelInfo.lora_adapters, Pong.lora_adapters, LORA / LORA_DONE.
# 7: AddRequest gained images (ImageInput).
# 8: speech: AddRequest.audio (AudioInput), RequestOutput.segments and language, TASKS transcribe.
# 9: ImageInput gained runs (the span's positions that take rows) and tiled shapes [N, C, H, W].
# 10: ModelInfo gained max_image_pixels.
PROTOCOL_VERSION = 10

# What a request asks of the model: tokens (generate), its pooled vector (embed), a relevance
# score from its last position's logits (score), or the text of its audio (transcribe, a speech
# model's only task). Embed and score are prefill only.
TASKS = ("generate", "embed", "score", "transcribe")


# -- sampling parameters: built by the gateway, carried in AddRequest, applied by the engine --

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class StructuredSpec(msgspec.Struct, array_like=True, gc=False):
    """A constraint on the output, compiled by the engine (llguidance).

    ``kind`` is one of ``STRUCTURED_KINDS``; ``spec`` is the JSON schema text
    (json_schema), ignored (json_object), a regular expression (regex), a JSON
    list of strings (choice), or a Lark grammar (grammar).
    """

    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """What to generate for one request (one choice; ``n > 1`` is fanned out by the gateway).

    Fields may only be appended: the struct travels as an array.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top k
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # False opts this request out of speculative decoding.
    speculate: bool = True
    # Constrained decoding; None: unconstrained.
    structured: StructuredSpec | None = None

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first field out of range.

        The ranges are what the engine's sampler and the msgpack wire can
        hold: an int the engine cannot take (a top_k past the vocabulary, a
        seed past int64) must never reach a step.
        """
        checks = (
            ("max_tokens", 1 <= self.max_tokens <= INT32_MAX, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", -1 <= self.top_k <= vocab_size, f"must be -1 or 0 (off), or in [1, {vocab_size}]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 100.0, "must be in (0, 100]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("seed", self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "must fit in a signed 64-bit integer"),
            (
                "logit_bias",
                not self.logit_bias or all(0 <= t < vocab_size for t in self.logit_bias),
                f"token ids must be in [0, {vocab_size})",
            ),
            (
                "stop_token_ids",
                all(0 <= t < vocab_size for t in self.stop_token_ids),
                f"token ids must be in [0, {vocab_size})",
            ),
        )
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}", param="structured")
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {why}", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Kind(bytes, enum.Enum):
    HELLO = b"\x01"  # gateway -> engine: Hello
    READY = b"\x02"  # engine -> gateway: EngineInfo
    ADD = b"\x03"  # gateway -> engine: AddRequest
    ABORT = b"\x04"  # gateway -> engine: Abort
    OUTPUTS = b"\x05"  # engine -> gateway: StepOutputs (one per step per gateway)
    ERROR = b"\x06"  # engine -> gateway: Error (a request's, or the handshake's)
    PING = b"\x07"  # gateway -> engine: Ping
    PONG = b"\x08"  # engine -> gateway: Pong
    DEAD = b"\x09"  # engine -> gateway: Dead, the engine's last word
    BYE = b"\x0a"  # gateway -> engine: Bye, a gateway leaving (its requests are aborted)
    LORA = b"\x0b"  # gateway -> engine: LoraUpdate (load or unload an adapter at runtime)
    LORA_DONE = b"\x0c"  # engine -> gateway: LoraAdapters, the answer to a LoraUpdate that succeeded


class Logprob(msgspec.Struct, array_like=True, gc=False):
    """Log-probability of one generated token, with the top alternatives when asked for."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """What one engine step produced for one request.

    ``new_token_ids`` includes the stop token that ended the request (it counts
    as a completion token, as in vLLM); ``stop_token_id`` names it so that the
    gateway leaves it out of the text.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[Logprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    stop_token_id: int | None = None
    # An embed request's pooled vector (float32, little-endian, ``embedding_dim`` of them) and a
    # score request's probability, in its last output.
    embedding: bytes | None = None
    score: float | None = None
    # A transcription's segments completed since its last output, and the language it was
    # transcribed in (the one asked for, or the one detected).
    segments: list[Segment] | None = None
    language: str | None = None


class Segment(msgspec.Struct, array_like=True, gc=False):
    """A timed stretch of a transcription (seconds from the file's start), with Whisper's
    measures of the window that produced it."""

    id: int
    seek: int  # the window's first frame (10 ms each)
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class EngineStats(msgspec.Struct, array_like=True, gc=False):
    """A snapshot of the scheduler and the block pool: ``Engine.stats()``, and a PONG's payload
    with the daemon's step and socket times filled in."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    # Since the engine started, while requests were running: seconds inside
    # Engine.step(), and seconds of the daemon's own socket work between steps.
    step_seconds: float = 0.0
    io_seconds: float = 0.0
    num_steps: int = 0
    # Prefix cache lookups and hits, in blocks, since the engine started (last: an older
    # peer's shorter array still decodes).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Hello(msgspec.Struct, kw_only=True):
    protocol_version: int
    gateway_version: str = ""
    pid: int = 0


class LoraAdapter(msgspec.Struct, kw_only=True):
    """An adapter the engine serves: ``name`` is the model name requests use for it."""

    name: str
    path: str


class ModelInfo(msgspec.Struct, kw_only=True):
    """What the engine serves, as the in-process Engine reports it."""

    model_id: str
    served_model_name: str
    tokenizer_dir: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int
    eos_token_ids: list[int]
    # The TASKS this model serves (``--task``), the length of its pooled vectors (0: none), and
    # the sizes it was trained to be cut to (Matryoshka; None: cutting is refused, [] any size).
    tasks: list[str] = msgspec.field(default_factory=lambda: ["generate"])
    embedding_dim: int = 0
    matryoshka_dimensions: list[int] | None = None
    enable_lora: bool = False
    lora_adapters: list[LoraAdapter] = []
    # The most pixels an image may keep after the gateway's processor resizes it (Qwen-VL's dynamic
    # resolution, within what the engine's memory guard measured its tower on); None: no bound to
    # apply (a text model, or a family whose processor's own sizes bound its images).
    max_image_pixels: int | None = None


class EngineInfo(ModelInfo, kw_only=True):
    """The engine's answer to HELLO: what a gateway needs to serve its model."""

    protocol_version: int
    engine_version: str
    # Random per engine process: a gateway that sees it change knows the engine restarted.
    instance_id: str
    pid: int = 0


class AddRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Requests share cached prefix blocks only when their salts are equal.
    cache_salt: str | None = None
    # The app whose key authenticated the request (None: no per-app key), for fair share.
    app: str | None = None
    # vLLM's convention: lower is admitted earlier.
    priority: int = 0
    # The client request this one belongs to (its prompts x n), sent one after another: the
    # engine admits or refuses all ``group_size`` of them against its waiting queue at once.
    group: str | None = None
    group_size: int = 1
    # The client request's n, and which of its prompt's n choices this is: vLLM's
    # request_params_n, observed once per prompt (on its choice 0), as vLLM does per parent request.
    n: int = 1
    choice: int = 0
    task: str = "generate"  # one of TASKS
    # The LoRA adapter to run under (a name of ModelInfo.lora_adapters); None: the base model.
    lora_name: str | None = None
    # The prompt's images, in prompt order (a vision-language model only).
    images: list[ImageInput] | None = None
    # A transcription's audio (task transcribe; a speech model only); prompt_token_ids then hold
    # the client's prompt text, which conditions the first window.
    audio: AudioInput | None = None


class AudioInput(msgspec.Struct, array_like=True, gc=False):
    """What to transcribe: ``samples`` are float32 little-endian, 16 kHz mono (the gateway
    decodes the file). ``language`` is an ISO 639-1 code (None: detected); ``translate`` asks for
    English text; each window is decoded at ``temperatures[0]`` and again at the next one when
    its text looks wrong (Whisper's fallback); ``seed`` seeds the sampling above 0."""

    samples: bytes
    language: str | None = None
    translate: bool = False
    temperatures: list[float] = msgspec.field(default_factory=lambda: [0.0])
    seed: int = 0


class ImageInput(msgspec.Struct, array_like=True, gc=False):
    """One image of a prompt, as the model's processor made it: ``pixels`` (float32, C-order, of
    ``shape``: [C, H, W], or [N, C, H, W] for an image the processor cut into N tiles, whose rows
    follow one another, or Qwen-VL's patches as [grid h, grid w, patch values]) fill the span of
    ``length`` prompt positions from ``offset``. ``runs`` are [start, length] pairs, relative to
    ``offset`` and in order, of the span's positions that take the rows; the others (a family's
    row breaks and tile markers) keep their own tokens' embeddings. None: every position takes a
    row. ``mm_hash`` is the digest of the image's bytes: it enters the prefix-cache hash of every
    block holding its span, so equal tokens of another image never share K/V."""

    mm_hash: str
    offset: int
    length: int
    shape: list[int]
    pixels: bytes
    runs: list[list[int]] | None = None


class Abort(msgspec.Struct, array_like=True, gc=False):
    request_ids: list[str]


class StepOutputs(msgspec.Struct, array_like=True, gc=False):
    """Everything one engine step produced for the requests of one gateway."""

    outputs: list[RequestOutput]


class Error(msgspec.Struct, kw_only=True):
    """A request refused or failed (``request_id`` set), or a refused handshake (None).

    ``code`` is an ``MlxdError.code``; ``shared.errors.error_from_code`` rebuilds it.
    """

    request_id: str | None
    code: str
    message: str
    param: str | None = None


class Ping(msgspec.Struct, array_like=True):
    sent_at: float = 0.0


class Pong(msgspec.Struct, array_like=True):
    instance_id: str
    sent_at: float
    stats: EngineStats
    # The adapters served now: every gateway learns of one loaded through another.
    lora_adapters: list[LoraAdapter] = []


class LoraUpdate(msgspec.Struct, kw_only=True):
    """Load (``lora_path`` given) or unload an adapter; answered by LoraAdapters, or Error(request_id=op_id)."""

    op_id: str
    action: str  # "load" | "unload"
    lora_name: str
    lora_path: str | None = None


class LoraAdapters(msgspec.Struct, kw_only=True):
    op_id: str
    adapters: list[LoraAdapter]


class Dead(msgspec.Struct, kw_only=True):
    reason: str


class Bye(msgspec.Struct, array_like=True):
    pass


PAYLOAD_TYPES: dict[Kind, type] = {
    Kind.HELLO: Hello,
    Kind.READY: EngineInfo,
    Kind.ADD: AddRequest,
    Kind.ABORT: Abort,
    Kind.OUTPUTS: StepOutputs,
    Kind.ERROR: Error,
    Kind.PING: Ping,
    Kind.PONG: Pong,
    Kind.DEAD: Dead,
    Kind.BYE: Bye,
    Kind.LORA: LoraUpdate,
    Kind.LORA_DONE: LoraAdapters,
}

_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(t) for kind, t in PAYLOAD_TYPES.items()}


class MalformedFrame(ValueError):
    """A frame that is not ``[kind, payload]`` of a known kind with a payload of its type."""


def encode(kind: Kind, payload: msgspec.Struct) -> list[bytes]:
    """The frames of one message (without the ROUTER's identity)."""
    return [kind.value, _encoder.encode(payload)]


def decode(frames: list[bytes]) -> tuple[Kind, msgspec.Struct]:
    """Parse ``[kind, payload]``; raises MalformedFrame for anything else."""
    if len(frames) != 2:
        raise MalformedFrame(f"expected 2 frames, got {len(frames)}")
    try:
        kind = Kind(bytes(frames[0]))
    except ValueError:
        raise MalformedFrame(f"unknown kind {bytes(frames[0])[:8]!r}") from None
    try:
        return kind, _decoders[kind].decode(frames[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedFrame(f"bad {kind.name} payload: {e}") from None
