"""One transcription's state in the speech engine: its features, where it is in the file, and the
window being decoded (the tokens fed so far, those sampled, their log-probabilities)."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from mlxd.engined.request import Request
from mlxd.engined.speech.decoding import (COMPRESSION_RATIO_THRESHOLD, LOGPROB_THRESHOLD, NO_SPEECH_THRESHOLD,
                                          Vocabulary, compression_ratio, split_window)
from mlxd.engined.speech.features import SECONDS_PER_FRAME
from mlxd.shared.protocol import AudioInput, Segment


class Transcription:
    def __init__(self, req: Request, audio: AudioInput, language: int | None):
        self.req = req  # for the metrics and the outputs (``take_output``)
        self.audio = audio
        self.pending_features: Future | None = None  # until admitted (``SpeechEngine._admit``)
        self.features: np.ndarray | None = None  # [n_mels, frames] of the whole file
        self.content_frames = 0
        self.seek = 0
        self.language = language  # its token; None: detected on the first window
        self.temperature_index = 0
        self.rng = np.random.default_rng(audio.seed)
        # Tokens that condition the next window: the client's prompt, then each window's tokens
        # since the last window decoded hot (above 0.5), as Whisper does.
        self.history: list[int] = list(req.token_ids)
        self.reset_since = 0
        self.segments: list[Segment] = []  # completed, not yet sent
        self.next_segment_id = 0
        self.slot = -1
        # The window in flight (``prompt`` is None between windows, until the encoder ran).
        self.prompt: list[int] | None = None
        self.window_size = 0
        self.sot_index = 0
        self.position = 0
        self.sampled: list[int] = []
        self.sum_logprob = 0.0
        self.no_speech_prob = 0.0

    @property
    def temperature(self) -> float:
        return self.audio.temperatures[self.temperature_index]

    @property
    def done(self) -> bool:
        return self.seek >= self.content_frames

    def begin_window(self, vocab: Vocabulary, size: int, n_text_ctx: int) -> None:
        self.window_size = size
        self.prompt = vocab.window_prompt([], self.history[self.reset_since:], self.language,
                                          self.audio.translate, n_text_ctx)
        self.sot_index = self.prompt.index(vocab.sot)
        self.restart()

    def restart(self) -> None:
        """Decode the window again, from <|startoftranscript|>: the K/V of the encoder and of the
        conditioning text before it (``SpeechEngine._prefill``) are kept."""
        self.position = self.sot_index
        self.sampled = []
        self.sum_logprob = 0.0

    def next_token(self) -> int:
        p = self.position
        return self.prompt[p] if p < len(self.prompt) else self.sampled[p - len(self.prompt)]

    def end_window(self, vocab: Vocabulary) -> bool:
        """Judge the window just decoded: False when it is to be decoded again at the next
        temperature; else take its segments, move ``seek`` on, and return True."""
        tokens = self.sampled[:-1] if self.sampled and self.sampled[-1] == vocab.eot else list(self.sampled)
        avg_logprob = self.sum_logprob / (len(tokens) + 1)
        text = vocab.text(tokens)
        ratio = compression_ratio(text)
        silent = self.no_speech_prob > NO_SPEECH_THRESHOLD and avg_logprob < LOGPROB_THRESHOLD
        doubtful = ratio > COMPRESSION_RATIO_THRESHOLD or avg_logprob < LOGPROB_THRESHOLD
        if doubtful and not silent and self.temperature_index + 1 < len(self.audio.temperatures):
            self.temperature_index += 1
            self.restart()
            return False
        temperature = self.temperature
        self.temperature_index = 0
        self.prompt = None
        if silent:
            self.seek += self.window_size
            return True
        offset = self.seek * SECONDS_PER_FRAME
        pieces, consumed = split_window(tokens, offset, self.window_size, vocab)
        for piece in pieces:
            piece_text = vocab.text(piece.tokens)
            if piece.end <= piece.start or not piece_text.strip():
                continue
            self.segments.append(Segment(
                id=self.next_segment_id, seek=self.seek, start=round(piece.start, 3), end=round(piece.end, 3),
                text=piece_text, tokens=[t for t in piece.tokens if t < vocab.eot], temperature=temperature,
                avg_logprob=avg_logprob, compression_ratio=ratio, no_speech_prob=self.no_speech_prob))
            self.next_segment_id += 1
        self.seek += max(1, consumed)
        self.history += tokens
        if temperature > 0.5:
            self.reset_since = len(self.history)
        return True
