"""A Hugging Face tokenizer directory built from a GGUF file's metadata.

transformers can read a GGUF tokenizer itself, but only with torch installed,
so the vocabulary, merges and token types are turned into a ``tokenizers``
object here and saved as ``tokenizer.json`` + ``tokenizer_config.json``. The
gateway then loads it with ``AutoTokenizer.from_pretrained(dir)`` like any
other model directory.

Supported vocabularies: ``gpt2`` (byte-level BPE, used by SmolLM2, Qwen,
Qwen3.5, Llama 3, gpt-oss), ``gemma4`` (SentencePiece pieces with their
merges stored) and ``llama`` (SentencePiece BPE with byte fallback, Llama 2 and
Mistral).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from mlxd.shared.errors import ModelLoadError
from mlxd.shared.paths import cache_dir

log = logging.getLogger(__name__)

# Part of the cache key: bump when the directory written here changes, so
# that tokenizers built by an older mlxd are not reused.
_FORMAT = 2

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`: the same regular
# expressions the original Hugging Face tokenizers of these families use.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: Qwen2's, with combining marks (\p{M}) kept inside words.
_QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss's "gpt-4o"): words split at case changes, numbers in threes.
_O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (split pattern, digits split one by one before it)
_PRE = {
    "default": (_GPT2_PATTERN, False),
    "gpt-2": (_GPT2_PATTERN, False),
    "gpt2": (_GPT2_PATTERN, False),
    "smollm": (_GPT2_PATTERN, True),
    "starcoder": (_GPT2_PATTERN, True),
    "llama-bpe": (_LLAMA3_PATTERN, False),
    "llama3": (_LLAMA3_PATTERN, False),
    "qwen2": (_QWEN2_PATTERN, False),
    "qwen35": (_QWEN35_PATTERN, False),
    "gpt-4o": (_O200K_PATTERN, False),
}


def meta_value(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    # mx.load returns scalars as 0-d arrays.
    return v.item() if hasattr(v, "item") else v


def meta_list(meta: dict, key: str) -> list:
    v = meta.get(key)
    if v is None:
        return []
    return v.tolist() if hasattr(v, "tolist") else list(v)


def cache_dir_for(gguf_path: str | os.PathLike) -> Path:
    """Where the tokenizer of this GGUF file is kept: keyed by the file's path, size and mtime."""
    st = os.stat(gguf_path)
    key = f"{_FORMAT}\0{os.path.realpath(gguf_path)}\0{st.st_size}\0{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return Path(cache_dir()) / "tokenizers" / digest


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    if pre not in _PRE:
        log.warning("GGUF pre-tokenizer %r is not known; splitting text like GPT-2", pre)
    pattern, split_digits = _PRE.get(pre, _PRE["default"])
    steps = []
    if split_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _merges_by_score(vocab: dict[str, int], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    # SentencePiece BPE merges the pair whose merged piece has the highest
    # score; a BPE merge list ordered by that score reproduces it.
    ranked = []
    for piece, idx in vocab.items():
        if types and types[idx] not in (NORMAL, USER_DEFINED):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[idx], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool, merge_list: list[str] | None = None
) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merge_list:
        # Gemma 4's files carry the merges themselves.
        merges = [tuple(m.split(" ", 1)) for m in merge_list]
    else:
        merges = _merges_by_score(vocab, scores, types)
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def build_tokenizer_dir(meta: dict, gguf_path: str | os.PathLike) -> Path:
    """Write (once) and return a directory that AutoTokenizer loads offline."""
    out = cache_dir_for(gguf_path)
    if (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists():
        return out

    kind = meta_value(meta, "tokenizer.ggml.model")
    tokens = meta_list(meta, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{gguf_path}: the GGUF file carries no tokenizer vocabulary")
    types = [int(t) for t in meta_list(meta, "tokenizer.ggml.token_type")] or [NORMAL] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(tokens, meta_list(meta, "tokenizer.ggml.merges"), meta_value(meta, "tokenizer.ggml.pre", "default"))
    elif kind in ("llama", "gemma4"):
        scores = [float(s) for s in meta_list(meta, "tokenizer.ggml.scores")] or [0.0] * len(tokens)
        space = bool(meta_value(meta, "tokenizer.ggml.add_space_prefix", kind == "llama"))
        tok = _sentencepiece_bpe(tokens, scores, types, space, meta_list(meta, "tokenizer.ggml.merges"))
    else:
        raise ModelLoadError(
            f"{gguf_path}: tokenizer model {kind!r} is not supported "
            "(supported: gpt2 byte-level BPE, llama and gemma4 SentencePiece)"
        )

    # Control tokens (<|im_start|>, <s>) are special: matched whole before the
    # model splits text, and skipped when decoding with skip_special_tokens.
    # User-defined ones are matched whole too but are ordinary text.
    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, USER_DEFINED, UNKNOWN):
            added.append(AddedToken(t, special=ty != USER_DEFINED, normalized=False))
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])

    def token(key: str) -> str | None:
        idx = meta_value(meta, key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta_value(meta, "tokenizer.ggml.add_bos_token", kind != "gpt2"))
    add_eos = bool(meta_value(meta, "tokenizer.ggml.add_eos_token", False))
    single, pair = "$A", "$A $B"
    if add_bos and bos is not None:
        single, pair = f"{bos} $A", f"{bos} $A {bos} $B"
    if add_eos and eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}"
    specials = [(t, tokens.index(t)) for t in {bos if add_bos else None, eos if add_eos else None} if t]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("tokenizer.ggml.unknown_token_id") if kind != "gpt2" else None,
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta_value(meta, f"{meta_value(meta, 'general.architecture')}.context_length", 0) or 0)
        or None,
    }
    template = meta_value(meta, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    config = {k: v for k, v in config.items() if v is not None}

    # Write into a private temporary directory and rename, so that two
    # processes loading the same file never see a half-written tokenizer.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    try:
        os.replace(tmp, out)
    except OSError:
        # Another process won the race; its directory is identical.
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return out
