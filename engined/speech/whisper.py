"""Whisper on MLX: the audio encoder and the text decoder, with the decoder batched over slots.

Names follow the mlxd layout of the weights (``checkpoints`` maps each checkpoint format onto
them). The decoder keeps its self-attention K/V and the encoder's cross-attention K/V in slot
arrays owned by the caller (``DecoderCache``): one slot per transcription in flight, so one
forward advances every active transcription by one token, each at its own position.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class WhisperArgs:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int


class Attention(nn.Module):
    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(dims, dims)
        self.key = nn.Linear(dims, dims, bias=False)
        self.value = nn.Linear(dims, dims)
        self.out = nn.Linear(dims, dims)

    def split(self, x: mx.array) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, -1).transpose(0, 2, 1, 3)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask=None) -> mx.array:
        """``q`` [B, T, D] against heads-split ``k``/``v`` [B, H, S, Dh]; ``mask`` additive or boolean."""
        q = self.split(q)
        scale = q.shape[-1] ** -0.5
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        b, _, t, _ = o.shape
        return self.out(o.transpose(0, 2, 1, 3).reshape(b, t, -1))


class EncoderBlock(nn.Module):
    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.attn = Attention(dims, heads)
        self.attn_ln = nn.LayerNorm(dims)
        self.mlp1 = nn.Linear(dims, 4 * dims)
        self.mlp2 = nn.Linear(4 * dims, dims)
        self.mlp_ln = nn.LayerNorm(dims)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.attn_ln(x)
        a = self.attn
        x = x + a.attend(a.query(h), a.split(a.key(h)), a.split(a.value(h)))
        return x + self.mlp2(nn.gelu(self.mlp1(self.mlp_ln(x))))


class AudioEncoder(nn.Module):
    def __init__(self, args: WhisperArgs):
        super().__init__()
        d = args.n_audio_state
        self.conv1 = nn.Conv1d(args.n_mels, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = mx.zeros((args.n_audio_ctx, d))
        self.blocks = [EncoderBlock(d, args.n_audio_head) for _ in range(args.n_audio_layer)]
        self.ln_post = nn.LayerNorm(d)

    def __call__(self, mel: mx.array) -> mx.array:
        """``mel`` [B, frames, n_mels] (frames = 2 * n_audio_ctx) -> [B, n_audio_ctx, d]."""
        x = nn.gelu(self.conv1(mel))
        x = nn.gelu(self.conv2(x))
        x = x + self.positional_embedding[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


class DecoderBlock(nn.Module):
    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.attn = Attention(dims, heads)
        self.attn_ln = nn.LayerNorm(dims)
        self.cross_attn = Attention(dims, heads)
        self.cross_attn_ln = nn.LayerNorm(dims)
        self.mlp1 = nn.Linear(dims, 4 * dims)
        self.mlp2 = nn.Linear(4 * dims, dims)
        self.mlp_ln = nn.LayerNorm(dims)


class DecoderCache:
    """The decoder's K/V for ``slots`` transcriptions, heads split: per layer, self-attention
    [slots, H, n_text_ctx, Dh] and cross-attention [slots, H, n_audio_ctx, Dh].

    The active transcriptions occupy slots 0..B-1 (the engine keeps them packed), so a step reads
    a prefix of each array, not a gather.
    """

    def __init__(self, args: WhisperArgs, slots: int, dtype):
        h, dh = args.n_text_head, args.n_text_state // args.n_text_head
        self.self_k = [mx.zeros((slots, h, args.n_text_ctx, dh), dtype) for _ in range(args.n_text_layer)]
        self.self_v = [mx.zeros((slots, h, args.n_text_ctx, dh), dtype) for _ in range(args.n_text_layer)]
        self.cross_k = [mx.zeros((slots, h, args.n_audio_ctx, dh), dtype) for _ in range(args.n_text_layer)]
        self.cross_v = [mx.zeros((slots, h, args.n_audio_ctx, dh), dtype) for _ in range(args.n_text_layer)]
        mx.eval(self.self_k, self.self_v, self.cross_k, self.cross_v)

    def arrays(self) -> list[mx.array]:
        return self.self_k + self.self_v + self.cross_k + self.cross_v

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into ``dst`` (packing the active slots after one leaves)."""
        for arrays in (self.self_k, self.self_v, self.cross_k, self.cross_v):
            for a in arrays:
                a[dst] = a[src]


class TextDecoder(nn.Module):
    def __init__(self, args: WhisperArgs):
        super().__init__()
        d = args.n_text_state
        self.token_embedding = nn.Embedding(args.n_vocab, d)
        self.positional_embedding = mx.zeros((args.n_text_ctx, d))
        self.blocks = [DecoderBlock(d, args.n_text_head) for _ in range(args.n_text_layer)]
        self.ln = nn.LayerNorm(d)

    def set_cross(self, cache: DecoderCache, slots: list[int], audio: mx.array) -> None:
        """Project the encoder's output ``audio`` [len(slots), n_audio_ctx, d] to each layer's
        cross-attention K/V, once per window, into ``slots``."""
        index = mx.array(slots)
        for i, block in enumerate(self.blocks):
            a = block.cross_attn
            cache.cross_k[i][index] = a.split(a.key(audio)).astype(cache.cross_k[i].dtype)
            cache.cross_v[i][index] = a.split(a.value(audio)).astype(cache.cross_v[i].dtype)

    def prefill(self, cache: DecoderCache, slots: mx.array, tokens: mx.array) -> None:
        """Feed ``tokens`` [R, L] at positions 0..L-1 of ``slots`` [R] in one forward, writing their
        K/V; no logits (the step feeds the token after them). Causal, so padding at the end of a
        row changes none of its positions, and the padding's K/V are written again before they are read."""
        n = tokens.shape[1]
        x = self.token_embedding(tokens) + self.positional_embedding[:n]
        for i, block in enumerate(self.blocks):
            a = block.attn
            h = block.attn_ln(x)
            k, v = a.split(a.key(h)), a.split(a.value(h))
            cache.self_k[i][slots, :, :n] = k.astype(cache.self_k[i].dtype)
            cache.self_v[i][slots, :, :n] = v.astype(cache.self_v[i].dtype)
            x = x + a.attend(a.query(h), k, v, "causal")
            c = block.cross_attn
            x = x + c.attend(c.query(block.cross_attn_ln(x)), cache.cross_k[i][slots], cache.cross_v[i][slots])
            x = x + block.mlp2(nn.gelu(block.mlp1(block.mlp_ln(x))))

    def step(self, cache: DecoderCache, tokens: mx.array, positions: mx.array, span: int | None = None) -> mx.array:
        """One token for each of slots 0..B-1: ``tokens`` and ``positions`` [B] (int32) -> logits
        [B, n_vocab] (float32). Writes each slot's K/V at its position; a slot attends to its
        positions 0..position only, within the first ``span`` (above every position; None: the
        whole context). The shapes depend on B and ``span`` alone, not on the positions, so a
        compiled trace of the step serves many steps."""
        b = tokens.shape[0]
        rows = mx.arange(b)
        span = span or cache.self_k[0].shape[2]
        mask = mx.arange(span)[None, :] <= positions[:, None]  # [B, span]
        mask = mask[:, None, None, :]
        x = self.token_embedding(tokens) + self.positional_embedding[positions]
        x = x[:, None, :]
        for i, block in enumerate(self.blocks):
            a = block.attn
            h = block.attn_ln(x)
            dtype = cache.self_k[i].dtype
            cache.self_k[i][rows, :, positions] = a.split(a.key(h))[:, :, 0].astype(dtype)
            cache.self_v[i][rows, :, positions] = a.split(a.value(h))[:, :, 0].astype(dtype)
            x = x + a.attend(a.query(h), cache.self_k[i][:b, :, :span], cache.self_v[i][:b, :, :span], mask)
            c = block.cross_attn
            x = x + c.attend(c.query(block.cross_attn_ln(x)), cache.cross_k[i][:b], cache.cross_v[i][:b])
            x = x + block.mlp2(nn.gelu(block.mlp1(block.mlp_ln(x))))
        x = self.ln(x[:, 0])
        return self.token_embedding.as_linear(x).astype(mx.float32)


class Whisper(nn.Module):
    def __init__(self, args: WhisperArgs):
        super().__init__()
        self.args = args
        self.encoder = AudioEncoder(args)
        self.decoder = TextDecoder(args)

    @property
    def is_multilingual(self) -> bool:
        return self.args.n_vocab >= 51865
