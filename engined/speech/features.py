"""Whisper's input features: 16 kHz mono samples -> a normalised log-mel spectrogram.

A 25 ms Hann window every 10 ms (400-point FFT, hop 160), the power spectrum through a
Slaney-style mel filter bank, log10, floored 8 (log10 units) below the loudest value of the whole
file, then scaled to about [-1, 1]. The file is analysed once; the engine cuts 30-second windows
(3,000 frames) out of it and pads the last with zeros, which is what the model was trained on.
"""

from __future__ import annotations

import functools

import numpy as np

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
WINDOW_FRAMES = 3000  # 30 s of frames: the encoder's input
SECONDS_PER_FRAME = HOP / SAMPLE_RATE


@functools.lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> np.ndarray:
    """[n_mels, N_FFT // 2 + 1] triangular filters on the Slaney mel scale (linear below 1 kHz,
    logarithmic above), each scaled to unit area so that bands of any width weigh alike."""
    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        linear = f / (200.0 / 3)
        log = 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) / (np.log(6.4) / 27.0)
        return np.where(f >= 1000.0, log, linear)

    def mel_to_hz(m):
        linear = m * (200.0 / 3)
        log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
        return np.where(m >= 15.0, log, linear)

    bins = np.fft.rfftfreq(N_FFT, 1.0 / SAMPLE_RATE)
    edges = mel_to_hz(np.linspace(0.0, hz_to_mel(SAMPLE_RATE / 2), n_mels + 2))
    widths = np.diff(edges)
    rising = (bins[None, :] - edges[:-2, None]) / widths[:-1, None]
    falling = (edges[2:, None] - bins[None, :]) / widths[1:, None]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    filters *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return filters.astype(np.float32)


def log_mel(samples: np.ndarray, n_mels: int) -> np.ndarray:
    """[n_mels, frames] features of ``samples`` (float32, 16 kHz), one frame per 10 ms."""
    x = np.pad(samples.astype(np.float32), (0, HOP))  # one hop of silence past the end
    x = np.pad(x, N_FFT // 2, mode="reflect")
    frames = 1 + (len(x) - N_FFT) // HOP
    windows = np.lib.stride_tricks.as_strided(x, (frames, N_FFT), (HOP * x.strides[0], x.strides[0]))
    hann = np.hanning(N_FFT + 1)[:-1].astype(np.float32)
    power = np.abs(np.fft.rfft(windows * hann, axis=-1).astype(np.complex64)[:-1]) ** 2
    mel = mel_filters(n_mels) @ power.T
    log = np.log10(np.maximum(mel, 1e-10))
    log = np.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).astype(np.float32)


def window(features: np.ndarray, seek: int) -> tuple[np.ndarray, int]:
    """The 30-second window of ``features`` starting at frame ``seek``, zero-padded, and how many
    of its frames hold audio (the file's frame count is ``features.shape[1] - 1``: the last frame
    covers the padding only)."""
    content = features.shape[1] - 1
    size = min(WINDOW_FRAMES, content - seek)
    out = np.zeros((features.shape[0], WINDOW_FRAMES), np.float32)
    out[:, :size] = features[:, seek:seek + size]
    return out, size
