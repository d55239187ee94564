"""Whisper's decoding rules: the special tokens, the window's prompt, the logit filters, and how
a window's tokens become timed segments.

The filters are Whisper's own (they decide what a greedy decode produces, so a server that skips
them transcribes differently from every other Whisper): the model's suppressed tokens at every
step, a blank or end at the first, and the timestamp grammar (text comes between pairs of
timestamps, timestamps never go back, the first token is a timestamp within the first second, and
a timestamp is forced when all timestamps together outweigh the likeliest text token).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from mlxd.engined.speech.features import SECONDS_PER_FRAME

# Window frames per timestamp step: the encoder halves the frame rate, a timestamp counts 0.02 s.
FRAMES_PER_TIMESTAMP = 2
SECONDS_PER_TIMESTAMP = FRAMES_PER_TIMESTAMP * SECONDS_PER_FRAME
MAX_INITIAL_TIMESTAMP = 50  # the first timestamp is within 1 s of the window's start
# Whisper's thresholds: a window is decoded again at the next temperature when its text compresses
# too well (a loop) or its tokens are unlikely; it is silence when <|nospeech|> is likely and the
# text unlikely.
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6


@dataclass(frozen=True)
class Vocabulary:
    """The special tokens of a Whisper tokenizer, and the text decoder."""

    tokenizer: Tokenizer
    eot: int
    sot: int
    sot_prev: int
    translate: int
    transcribe: int
    no_speech: int
    no_timestamps: int
    languages: dict[str, int]  # code -> token; {} for an English-only model
    suppress: np.ndarray  # suppressed at every step (with <|notimestamps|>)

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    def text(self, tokens) -> str:
        return self.tokenizer.decode([t for t in tokens if t < self.eot])

    @classmethod
    def load(cls, path: Path, multilingual: bool) -> Vocabulary:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))

        def tid(*names: str) -> int:
            for name in names:
                i = tok.token_to_id(name)
                if i is not None:
                    return i
            raise ValueError(f"tokenizer.json has none of {names}")

        languages = {}
        if multilingual:
            for name, i in tok.get_vocab(with_added_tokens=True).items():
                code = name[2:-2]
                if name.startswith("<|") and name.endswith("|>") and 2 <= len(code) <= 3 and code.isalpha() \
                        and code.islower() and i > tid("<|startoftranscript|>") and i < tid("<|translate|>"):
                    languages[code] = i
        specials = [tid("<|translate|>"), tid("<|transcribe|>"), tid("<|startoftranscript|>"),
                    tid("<|startofprev|>"), tid("<|startoflm|>"), tid("<|nospeech|>", "<|nocaptions|>")]
        suppress = _suppress_list(path)
        return cls(tokenizer=tok, eot=tid("<|endoftext|>"), sot=tid("<|startoftranscript|>"),
                   sot_prev=tid("<|startofprev|>"), translate=specials[0], transcribe=specials[1],
                   no_speech=specials[5], no_timestamps=tid("<|notimestamps|>"), languages=languages,
                   suppress=np.unique(np.array(suppress + specials + [tid("<|notimestamps|>")], np.int64)))

    def window_prompt(self, initial: list[int], previous: list[int], language: int | None,
                      translate: bool, n_text_ctx: int) -> list[int]:
        """The tokens fed before a window's text: the conditioning text after <|startofprev|>
        (the client's prompt, then the text so far, at most half the context), then
        <|startoftranscript|>, the language and the task (multilingual models only)."""
        context = (initial + previous)[-(n_text_ctx // 2 - 1):]
        prompt = [self.sot_prev, *context] if context else []
        prompt.append(self.sot)
        if language is not None:
            prompt += [language, self.translate if translate else self.transcribe]
        return prompt


def _suppress_list(path: Path) -> list[int]:
    """The model's suppressed tokens: a CTranslate2 ``config.json`` (suppress_ids) or a Hugging
    Face ``generation_config.json`` (suppress_tokens). (Those barred at a window's first step, a
    blank and the end, are text: the first step takes a timestamp only.)"""
    for name, key in (("config.json", "suppress_ids"), ("generation_config.json", "suppress_tokens")):
        try:
            config = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and key in config:
            return list(config[key])
    return []


def token_limits(sampled: list[int], vocab: Vocabulary) -> tuple[int, int, int]:
    """Whisper's timestamp grammar for a row's next token, given the tokens sampled so far this
    window, as three bounds: tokens below ``text_end`` are barred, and timestamps outside
    [``stamp_lo``, ``stamp_hi``) (end of vocabulary: ``n_vocab``, passed as -1)."""
    tb = vocab.timestamp_begin
    if not sampled:  # the window opens with a timestamp within its first second
        return tb, tb, tb + MAX_INITIAL_TIMESTAMP + 1
    last = sampled[-1] >= tb
    penultimate = len(sampled) < 2 or sampled[-2] >= tb
    if last and penultimate:  # a pair just closed: text (or the end) follows
        return 0, -1, -1
    stamps = [t for t in sampled if t >= tb]
    floor = tb if not stamps else stamps[-1] if last else stamps[-1] + 1
    # after text's opening timestamp: more text; after text: a closing timestamp or more text;
    # after a lone closing timestamp: its pair's second timestamp or the end, no text
    return (vocab.eot if last else 0), floor, -1


def filter_logits(logits: mx.array, limits: mx.array, suppress: mx.array, tb: int) -> mx.array:
    """Whisper's filters on a batch: ``logits`` [R, V], ``limits`` [R, 3] int32 (``token_limits``),
    ``suppress`` [V] bool (the model's suppressed tokens). The filtered logits, -inf where barred;
    where all timestamps together outweigh the likeliest text token, text is barred too."""
    v = logits.shape[-1]
    ids = mx.arange(v)[None, :]
    lim = mx.where(limits < 0, v, limits)
    text_end, lo, hi = lim[:, 0:1], lim[:, 1:2], lim[:, 2:3]
    barred = suppress[None, :] | (ids < text_end) | ((ids >= tb) & ((ids < lo) | (ids >= hi)))
    x = mx.where(barred, -mx.inf, logits)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    stamps = mx.logsumexp(lp[:, tb:], axis=-1, keepdims=True)
    text = mx.max(lp[:, :tb], axis=-1, keepdims=True)
    return mx.where((stamps > text) & (ids < tb), -mx.inf, x)


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass
class Piece:
    """A timed stretch of a window's text (seconds from the file's start)."""

    start: float
    end: float
    tokens: list[int]


def split_window(tokens: list[int], offset: float, size: int, vocab: Vocabulary) -> tuple[list[Piece], int]:
    """A window's sampled tokens (end token excluded) -> its timed pieces, and how many frames the
    window consumed: all ``size`` of them, or up to the last complete pair of timestamps, so that
    speech cut off at the window's end is decoded again at the start of the next."""
    tb = vocab.timestamp_begin
    is_stamp = [t >= tb for t in tokens]
    single_end = len(tokens) >= 2 and not is_stamp[-2] and is_stamp[-1]
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_stamp[i] and is_stamp[i + 1]]
    if not cuts:
        stamps = [t for t in tokens if t >= tb]
        duration = size * SECONDS_PER_FRAME
        if stamps and stamps[-1] != tb:
            duration = (stamps[-1] - tb) * SECONDS_PER_TIMESTAMP
        return [Piece(offset, offset + duration, tokens)], size
    if single_end:
        cuts.append(len(tokens))
    pieces, last = [], 0
    for cut in cuts:
        part = tokens[last:cut]
        pieces.append(Piece(offset + (part[0] - tb) * SECONDS_PER_TIMESTAMP,
                            offset + (part[-1] - tb) * SECONDS_PER_TIMESTAMP, part))
        last = cut
    consumed = size if single_end else (tokens[last - 1] - tb) * FRAMES_PER_TIMESTAMP
    return pieces, consumed
