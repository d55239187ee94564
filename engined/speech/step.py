"""The decoder step as one compiled graph: the forward of every transcription in flight, Whisper's
filters, and each row's greedy token, its log-probability and the no-speech probability.

For a model of Whisper's size a GPU's step is bound by the host: building the graph in Python node
by node and launching it cost more than the device's work (on one H100 a c = 1 transcription of 46
steps took ~200 ms, ``bench/speech_results.md``). So the step is traced with ``mx.compile`` and
replayed, its elementwise runs fused. A batch is padded to a power of two (at most the slot count)
and the self-attention's span (positions read, masked past each row's own) to a multiple of
``SPAN_STEP``, so a few traces serve every step: no shape follows the positions step by step. A
padded row writes its K/V into an idle slot at position 0, which the slot's next transcription
writes again before it reads it.

The host gets one small array per step (``readout``); the filtered logits stay on the device for the
rows that sample at a temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxd.engined.speech.decoding import Vocabulary, filter_logits
from mlxd.engined.speech.whisper import DecoderCache, Whisper

SPAN_STEP = 64
# readout's columns: the greedy token, its log-probability, the no-speech probability, then (for a
# multilingual model) the logits of the language tokens.
TOKEN, LOGPROB, NO_SPEECH, LANGUAGES = 0, 1, 2, 3


@dataclass
class _Slots:
    """The cache's arrays as the traced step sees them (``TextDecoder.step`` writes the lists)."""

    self_k: list
    self_v: list
    cross_k: list
    cross_v: list


@dataclass
class StepOutput:
    readout: mx.array  # [B, 3 (+ languages)] float32: the columns above
    logits: mx.array  # [B, V] filtered, -inf where barred
    logz: mx.array  # [B] their log-sum-exp: a sampled token's log-probability is logits - logz


class DecodeStep:
    def __init__(self, model: Whisper, cache: DecoderCache, vocab: Vocabulary, suppress: mx.array):
        self.decoder = model.decoder
        self.cache = cache
        self.num_slots = cache.self_k[0].shape[0]
        self.vocab = vocab
        self.suppress = suppress
        self.language_ids = mx.array(list(vocab.languages.values())) if vocab.languages else None
        self._run = mx.compile(self._forward)

    def __call__(self, tokens: np.ndarray, positions: np.ndarray, limits: np.ndarray) -> StepOutput:
        """One token for each of slots 0..B-1: ``tokens``, ``positions`` [B] and ``limits`` [B, 3]
        (``token_limits``). Not evaluated; the cache's self-attention arrays are replaced by their
        written versions."""
        n = len(tokens)
        pad = min(1 << (n - 1).bit_length(), self.num_slots) - n
        if pad:
            tokens, positions = np.pad(tokens, (0, pad)), np.pad(positions, (0, pad))
            limits = np.concatenate([limits, np.tile(np.array([0, -1, -1], np.int32), (pad, 1))])  # none barred
        c = self.cache
        span = min(-(-(int(positions.max()) + 1) // SPAN_STEP) * SPAN_STEP, c.self_k[0].shape[2])
        readout, logits, logz, c.self_k, c.self_v = self._run(
            mx.array(tokens, mx.int32), mx.array(positions, mx.int32), mx.array(limits, mx.int32),
            c.self_k, c.self_v, c.cross_k, c.cross_v, span)
        return StepOutput(readout[:n], logits[:n], logz[:n])

    def _forward(self, tokens, positions, limits, self_k, self_v, cross_k, cross_v, span: int):
        slots = _Slots(list(self_k), list(self_v), cross_k, cross_v)
        raw = self.decoder.step(slots, tokens, positions, span)
        x = filter_logits(raw, limits, self.suppress, self.vocab.timestamp_begin)
        logz = mx.logsumexp(x, axis=-1)
        chosen = mx.argmax(x, axis=-1)
        logprob = mx.take_along_axis(x, chosen[:, None], axis=-1)[:, 0] - logz
        no_speech = mx.exp(raw[:, self.vocab.no_speech] - mx.logsumexp(raw, axis=-1))
        columns = [chosen.astype(mx.float32)[:, None], logprob[:, None], no_speech[:, None]]
        if self.language_ids is not None:
            columns.append(raw[:, self.language_ids])
        return mx.concatenate(columns, axis=1), x, logz, slots.self_k, slots.self_v
