"""The engine for Whisper models: transcriptions, batched across requests at every stage.

A file's log-mel features are computed on worker threads from its arrival. Each step (1) admits
waiting transcriptions whose features are ready into free decoder slots, (2) runs the encoder once
for every transcription starting a 30-second window, in one batch, stores its cross-attention K/V
in the window's slot, and feeds the window's conditioning text (the text before it) in one decoder
forward for all of them, then (3) runs one decoder step for every transcription in flight, each
at its own position (``step.DecodeStep``: one compiled graph, one small read-back): a
transcription at <|startoftranscript|> or its language and task tokens is fed them, one that is
sampling gets its next token. A window that ends is judged (Whisper's temperature fallback and
silence test), its segments are sent, and the transcription moves on to its next window, or
finishes. It speaks ``engined.engine.Engine``'s interface (add_request / step / abort /
take_errors / stats / info / metrics), so the daemon and the wire do not know which engine they run.

The decoder's K/V live in slot arrays of the speech wing (``whisper.DecoderCache``), not in the
paged pool: a Whisper window's decode is at most 448 positions, and its cross-attention K/V are
fixed-size, so a slot per transcription costs little and needs no block tables.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxd.engined.device import device_kind
from mlxd.engined.loaders.mlx_dir import resolve_hf_repo
from mlxd.engined.metrics import EngineMetrics
from mlxd.engined.request import Request, Status, WaitingPlaces, take_output
from mlxd.engined.speech.checkpoints import checkpoint_format, load_whisper
from mlxd.engined.speech.decoding import Vocabulary, token_limits
from mlxd.engined.speech.features import log_mel, window
from mlxd.engined.speech.step import LANGUAGES, LOGPROB, NO_SPEECH, TOKEN, DecodeStep
from mlxd.engined.speech.transcription import Transcription
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import InvalidRequestError, ModelLoadError
from mlxd.shared.protocol import AudioInput, EngineStats, ModelInfo, RequestOutput, SamplingParams

log = logging.getLogger("mlxd.engine")

# The decoder slots' memory (self- and cross-attention K/V of every slot) is held to this, so
# that --max-num-seqs sized for a small model does not take a large one's whole memory.
SLOT_MEMORY = 4 << 30
# A prefill's length is padded to a multiple of this: few shapes, so few attention plans to build
# (cuDNN builds one per new shape: ~50 ms each, bench/kernels/sdpa_shapes_results.md).
PREFILL_STEP = 32
# Threads computing log-mel features (``_admit``): a 12-second file takes ~10 ms of one core.
FEATURE_THREADS = 2
# Windows per encoder forward: the encoder's activations grow with it; 8 keep a GPU busy.
ENCODE_BATCH = 8


def speech_dir(model: str) -> Path | None:
    """The model's folder (a path, or a repo id in the local Hugging Face cache) when it holds a
    Whisper checkpoint, else None."""
    if not model or model.endswith(".gguf"):
        return None
    path = Path(model)
    if not path.is_dir():
        if model.count("/") != 1 or model.startswith((".", "/", "~")):
            return None
        try:
            path = resolve_hf_repo(model)
        except ModelLoadError:
            return None  # not cached: the decoder engine's loader says so
    return path if checkpoint_format(path) is not None else None


class SpeechEngine:
    def __init__(self, config: EngineConfig, path: Path):
        from mlxd.engined.speech.whisper import DecoderCache

        if config.task != "auto":
            raise ModelLoadError(f"{path} is a Whisper model: it serves transcriptions (--task auto), "
                                 f"not {config.task}")
        config = config.for_device(device_kind())
        self.config = config
        dtype = mx.float32 if device_kind() == "cpu" else mx.float16
        self.model = load_whisper(path, dtype)
        self.args = self.model.args
        self.vocab = Vocabulary.load(path, self.model.is_multilingual)
        self.suppress = mx.zeros(self.args.n_vocab, dtype=mx.bool_)
        self.suppress[mx.array(self.vocab.suppress)] = True
        a = self.args
        slot_bytes = a.n_text_layer * 2 * (a.n_text_ctx + a.n_audio_ctx) * a.n_text_state * dtype.size
        self.num_slots = max(1, min(config.max_num_seqs, SLOT_MEMORY // slot_bytes))
        self.cache = DecoderCache(a, self.num_slots, dtype)
        self.step_fn = DecodeStep(self.model, self.cache, self.vocab, self.suppress)
        log.info("Whisper %s: %d decoder slots (%.0f MB)", path.name, self.num_slots,
                 self.num_slots * slot_bytes / 2**20)
        name = config.served_model_name or path.name
        self.info = ModelInfo(
            model_id=path.name, served_model_name=name, tokenizer_dir=str(path), max_model_len=a.n_text_ctx,
            block_size=config.block_size, num_kv_blocks=0, vocab_size=a.n_vocab,
            eos_token_ids=[self.vocab.eot], tasks=["transcribe"])
        # The log-mel features of each file, computed from its arrival on, off the engine's thread
        # (numpy's FFT and matmul let go of the GIL): ~10 ms a file that would otherwise stall
        # every transcription's step.
        self._mel = ThreadPoolExecutor(FEATURE_THREADS, thread_name_prefix="speech-features")
        self.places = WaitingPlaces(config.max_waiting_requests)
        self.waiting: deque[Transcription] = deque()
        self.running: list[Transcription] = []  # running[i] holds decoder slot i
        self.requests: dict[str, Transcription] = {}
        self._ended: list[RequestOutput] = []
        self._failed: list[tuple[str, InvalidRequestError]] = []
        self.metrics = EngineMetrics(name, config, a.n_text_ctx, self.stats)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, app: str | None = None, priority: int = 0,
                    group: str | None = None, group_size: int = 1, params_n: int = 1,
                    task: str = "generate", lora_name: str | None = None, images: list | None = None,
                    audio: AudioInput | None = None) -> None:
        """Queue a transcription of ``audio``; ``prompt_token_ids`` are the client's prompt (text
        tokens that condition the first window, maybe none)."""
        self.places.take(group, group_size, len(self.waiting))
        if task != "transcribe" or audio is None:
            raise InvalidRequestError(f"this model serves transcriptions (/v1/audio/transcriptions), not {task}")
        if lora_name is not None:
            raise InvalidRequestError(f"this model serves no LoRA adapters (asked for {lora_name!r})",
                                      param="lora_name")
        if images:
            raise InvalidRequestError("this model takes no images", param="messages")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not audio.samples or len(audio.samples) % 4:
            raise InvalidRequestError("the audio is empty", param="file")
        if not audio.temperatures or any(not 0.0 <= t <= 1.0 for t in audio.temperatures):
            raise InvalidRequestError("temperature must be in [0, 1]", param="temperature")
        if any(not 0 <= t < self.vocab.eot for t in prompt_token_ids):
            raise InvalidRequestError("prompt token ids out of range", param="prompt")
        req = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=self.args.n_text_ctx // 2),
                      0, b"", app or "", priority, params_n, "transcribe")
        t = Transcription(req, audio, self._language_token(audio.language))
        t.pending_features = self._mel.submit(log_mel, np.frombuffer(audio.samples, "<f4"), self.args.n_mels)
        self.requests[request_id] = t
        self.waiting.append(t)

    def _language_token(self, code: str | None) -> int | None:
        languages = self.vocab.languages
        if not languages:  # English-only: no language token in its prompt
            if code not in (None, "en"):
                raise InvalidRequestError(f"this model ({self.info.model_id}) transcribes English only; "
                                          f"language {code!r} is not supported", param="language")
            return None
        if code is None:
            return None
        if code not in languages:
            raise InvalidRequestError(f"language {code!r} is not one this model knows", param="language")
        return languages[code]

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            t = self.requests.get(rid)
            if t is not None:
                self._finish(t, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._ended or self._failed)

    def take_errors(self) -> list[tuple[str, InvalidRequestError]]:
        failed, self._failed = self._failed, []
        return failed

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting))

    def release_idle_memory(self) -> bool:
        return False  # the slots are sized at start and reused

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        try:
            self._admit(start)
            self._encode()
            sampled = self._decode() if self.running else 0
        except Exception as e:  # the batch broke: its transcriptions fail, the engine goes on
            log.warning("failing %d transcription(s): %s: %s", len(self.running), type(e).__name__, e)
            for t in list(self.running):
                self._finish(t, None)
                self._failed.append((t.req.request_id, InvalidRequestError(
                    f"the transcription failed: {type(e).__name__}: {e}")))
            sampled = 0
        outputs, self._ended = self._ended, []
        self.metrics.on_step(sampled, time.monotonic() - start, self.stats())
        return outputs

    def _admit(self, now: float) -> None:
        """Move waiting transcriptions whose features are ready into the free slots, by priority;
        with none running, wait for the features of those that fit (the step has nothing else to do,
        and they then share one encoder batch)."""
        free = self.num_slots - len(self.running)
        if not free or not self.waiting:
            return
        order = sorted(self.waiting, key=lambda t: (t.req.priority, t.req.arrival_time))
        if not self.running:
            wait([t.pending_features for t in order[:free]])
        for t in order:
            if not free:
                return
            if not t.pending_features.done():
                continue
            self.waiting.remove(t)
            try:
                t.features = t.pending_features.result()
            except Exception as e:  # this file's features failed: it fails alone
                self._finish(t, None)
                self._failed.append((t.req.request_id, InvalidRequestError(
                    f"the audio's features failed: {type(e).__name__}: {e}")))
                continue
            t.pending_features = None
            t.content_frames = t.features.shape[1] - 1
            t.slot = len(self.running)
            self.running.append(t)
            t.req.status, t.req.first_scheduled_time = Status.RUNNING, now
            free -= 1

    def _encode(self) -> None:
        """The encoder for every transcription that starts a window, ``ENCODE_BATCH`` at a time."""
        for t in [t for t in self.running if t.prompt is None and t.done]:
            self._finish(t, "stop")
        starting = [t for t in self.running if t.prompt is None]
        for i in range(0, len(starting), ENCODE_BATCH):
            batch = starting[i:i + ENCODE_BATCH]
            windows = [window(t.features, t.seek) for t in batch]
            mel = mx.array(np.stack([w.T for w, _ in windows]))
            audio = self.model.encoder(mel.astype(self.cache.cross_k[0].dtype))
            self.model.decoder.set_cross(self.cache, [t.slot for t in batch], audio)
            for t, (_, size) in zip(batch, windows):
                t.begin_window(self.vocab, size, self.args.n_text_ctx)
            self._prefill([t for t in batch if t.sot_index])
            mx.async_eval(self.cache.arrays())  # queued; the step's read waits for it

    def _prefill(self, batch: list[Transcription]) -> None:
        """The conditioning text before <|startoftranscript|> (up to 223 tokens of the text so far)
        in one decoder forward for the whole batch, not one step a token; each row's length padded
        to the longest, that to a multiple of ``PREFILL_STEP``."""
        if not batch:
            return
        n = min(-(-max(t.sot_index for t in batch) // PREFILL_STEP) * PREFILL_STEP, self.args.n_text_ctx)
        tokens = np.zeros((len(batch), n), np.int32)
        for row, t in zip(tokens, batch):
            row[:t.sot_index] = t.prompt[:t.sot_index]
        self.model.decoder.prefill(self.cache, mx.array([t.slot for t in batch]), mx.array(tokens))

    def _decode(self) -> int:
        """One decoder forward for every transcription in flight (``step.DecodeStep``); returns
        the tokens sampled. The host reads back one row per transcription: its token, the token's
        log-probability and the no-speech probability (and the languages' logits)."""
        running, vocab = self.running, self.vocab
        tokens = np.array([t.next_token() for t in running], np.int32)
        positions = np.array([t.position for t in running], np.int32)
        sampling = [i for i, t in enumerate(running) if t.position >= len(t.prompt) - 1]
        limits = np.zeros((len(running), 3), np.int32)
        limits[:, 1:] = -1  # rows still fed their prompt: no limits (their choice is not read)
        for i in sampling:
            limits[i] = token_limits(running[i].sampled, vocab)
        out = self.step_fn(tokens, positions, limits)
        # Fallback rows sample at their temperature, each from its own seeded stream.
        hot = [i for i in sampling if running[i].temperature > 0]
        if hot:
            picks = mx.stack([mx.random.categorical(out.logits[i] / running[i].temperature, key=mx.random.key(
                int(running[i].rng.integers(1 << 31)))) for i in hot])
            rows = mx.array(hot)
            hot_logprobs = out.logits[rows, picks] - out.logz[rows]
            mx.eval(out.readout, picks, hot_logprobs, *self.cache.arrays())
            readout = np.array(out.readout)
            readout[hot, TOKEN], readout[hot, LOGPROB] = np.array(picks), np.array(hot_logprobs)
        else:
            mx.eval(out.readout, *self.cache.arrays())
            readout = np.array(out.readout)
        ended = []
        for i, t in enumerate(running):
            if t.position == t.sot_index:
                t.no_speech_prob = float(readout[i, NO_SPEECH])
                if vocab.languages and t.language is None:
                    self._detect_language(t, readout[i, LANGUAGES:])
            t.position += 1
            if t.position < len(t.prompt):  # still fed its prompt (or it grew: the language was just detected)
                continue
            token = int(readout[i, TOKEN])
            t.sum_logprob += float(readout[i, LOGPROB])
            t.sampled.append(token)
            if token == vocab.eot or len(t.sampled) >= self.args.n_text_ctx // 2 \
                    or t.position >= self.args.n_text_ctx:
                ended.append(t)
        for t in ended:
            if t.end_window(vocab):
                self._send_segments(t)
        return len(sampling)

    def _detect_language(self, t: Transcription, scores: np.ndarray) -> None:
        """The likeliest language after <|startoftranscript|> (``scores``: the logits of the
        language tokens) becomes the transcription's; its prompt goes on with it and the task."""
        t.language = list(self.vocab.languages.values())[int(np.argmax(scores))]
        t.prompt += [t.language, self.vocab.translate if t.audio.translate else self.vocab.transcribe]

    def _send_segments(self, t: Transcription) -> None:
        if not t.segments:
            return
        new = [tok for s in t.segments for tok in s.tokens]
        t.req.pending_tokens = new
        t.req.token_ids += new  # the generation-token metrics count them
        self.metrics.on_tokens([(t.req, len(new))], time.monotonic())
        out = take_output(t.req)
        out.segments, t.segments = t.segments, []
        self._ended.append(out)

    def _finish(self, t: Transcription, reason: str | None) -> None:
        """Take ``t`` out (packing the slots); ``reason`` None: failed, no output."""
        del self.requests[t.req.request_id]
        if t in self.waiting:
            self.waiting.remove(t)
        elif t.slot >= 0:
            last = self.running.pop()
            if last is not t:
                self.cache.move(last.slot, t.slot)
                last.slot = t.slot
                self.running[t.slot] = last
            t.slot = -1
        t.req.status = Status.FINISHED
        if reason is None:
            return
        t.req.finish_reason = reason
        self.metrics.on_finish(t.req, time.monotonic())
        out = take_output(t.req)
        out.segments, t.segments = t.segments or None, []
        out.language = self._language_code(t.language)
        self._ended.append(out)

    def _language_code(self, token: int | None) -> str:
        for code, i in self.vocab.languages.items():
            if i == token:
                return code
        return "en"
