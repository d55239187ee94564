"""Encoder (sentence-transformers) embedding models on MLX: load a folder, embed batches of token ids.

The folder is a sentence-transformers model: a Hugging Face encoder (config.json + safetensors),
``modules.json`` naming the pipeline (Transformer -> Pooling -> optional Dense -> optional Normalize),
``1_Pooling/config.json`` and ``sentence_bert_config.json`` (``max_seq_length``). A plain Hugging
Face encoder folder without them gets sentence-transformers' own defaults: mean pooling, no
normalisation, the position table's length.

Why not PyPI's mlx-embeddings (inspected at 0.1.0): it needs mlx-vlm, which pulls opencv-python,
mlx-audio, datasets, fastapi and more into the engine; its loader imports huggingface_hub's
snapshot_download and transformers' AutoProcessor on every load; its package sets environment
variables at import time; and it is GPLv3. The encoder architectures are small, so mlxd keeps its
own (``bert.py``, ``modernbert.py``), written against Hugging Face's tensor names.

Batching: one call embeds a whole request set. Inputs are sorted by length and cut into chunks of
similar lengths (``_length_chunks``); each chunk is one padded forward with a key mask, so a
3-token string batched with a 200-token one is neither padded to 200 nor given its own forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxd.engined.encoders import bert, modernbert
from mlxd.shared.errors import InvalidRequestError, ModelLoadError

_FAMILIES = {t: family for family in (bert, modernbert) for t in family.MODEL_TYPES}

# Padded tokens per forward: bounds the attention scores ([chunk, heads, L, L] floats) and the
# activations of one forward while keeping matmuls large enough to run at full speed on a CPU.
TOKENS_PER_FORWARD = 8192
# Padding a chunk may add, as a fraction of its real tokens, before a longer row starts a new chunk:
# padding costs as much as real tokens, a new forward only its fixed overhead.
MAX_PADDING = 0.25

# sentence-transformers' legacy pooling flags, in its concatenation order.
_LEGACY_POOLING = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
    ("pooling_mode_weightedmean_tokens", "weightedmean"),
    ("pooling_mode_lasttoken", "lasttoken"),
)
_POOLING_MODES = {mode for _, mode in _LEGACY_POOLING}
_ST = "sentence_transformers.models."
_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": mx.tanh}


def _read_json(path: Path) -> dict | list | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from e


def _read_safetensors(folder: Path) -> dict[str, mx.array]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (convert pytorch_model.bin to safetensors)")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def _pooling_modes(config: dict | None) -> tuple[str, ...]:
    """The pooling modes of a ``1_Pooling/config.json``, old (flags) or new (``pooling_mode``) format."""
    if config is None:
        return ("mean",)
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(mode for key, mode in _LEGACY_POOLING if config.get(key)) or ("mean",)
    unknown = [m for m in modes if m not in _POOLING_MODES]
    if unknown:
        raise ModelLoadError(f"pooling mode {unknown} is not supported (one of {sorted(_POOLING_MODES)})")
    if config.get("include_prompt") is False:
        raise ModelLoadError("pooling with include_prompt=false is not supported")
    return modes


def _pool(hidden: mx.array, mask: mx.array, lengths: mx.array, modes: tuple[str, ...]) -> mx.array:
    """[B, L, H] hidden states of right-padded rows -> [B, H * len(modes)], as sentence-transformers pools."""
    maskf = mask[..., None].astype(hidden.dtype)
    count = mx.maximum(lengths.astype(hidden.dtype)[:, None], 1e-9)
    rows = mx.arange(hidden.shape[0])
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[:, 0])
        elif mode == "max":
            out.append(mx.where(maskf > 0, hidden, -mx.inf).max(axis=1))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = (hidden * maskf).sum(axis=1)
            out.append(total / (count if mode == "mean" else mx.sqrt(count)))
        elif mode == "weightedmean":
            weights = maskf * mx.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)[None, :, None]
            out.append((hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1e-9))
        else:  # lasttoken
            out.append(hidden[rows, lengths - 1])
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)


@dataclass
class _Dense:
    """A sentence-transformers Dense module: a linear map with an optional activation."""

    weight: mx.array
    bias: mx.array | None
    activation: object

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return y if self.activation is None else self.activation(y)

    @classmethod
    def load(cls, folder: Path) -> _Dense:
        config = _read_json(folder / "config.json") or {}
        # Absent, sentence-transformers' Dense defaults to Tanh.
        act = config.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act not in _DENSE_ACTIVATIONS:
            raise ModelLoadError(f"{folder}: Dense activation {act!r} is not supported")
        w = _read_safetensors(folder)
        if "linear.weight" not in w:
            raise ModelLoadError(f"{folder}: Dense weights have no linear.weight")
        bias = w.get("linear.bias")
        return cls(w["linear.weight"].astype(mx.float32), None if bias is None else bias.astype(mx.float32),
                   _DENSE_ACTIVATIONS[act])


class EncoderModel:
    """A loaded encoder embedding model. ``embed`` is not re-entrant: call it from one thread."""

    def __init__(self, encoder: nn.Module, modes: tuple[str, ...], dense: list[_Dense], normalize: bool,
                 max_length: int, vocab_size: int, pad_id: int, sep_id: int | None, hidden: int):
        self._encoder = encoder
        self._modes = modes
        self._dense = dense
        self._normalize = normalize
        self._vocab_size = vocab_size
        self._pad_id = pad_id
        self._sep_id = sep_id
        self.max_length = max_length
        self.dim = dense[-1].weight.shape[0] if dense else hidden * len(modes)
        params = [v for _, v in tree_flatten(encoder.parameters())]
        params += [a for d in dense for a in (d.weight, d.bias) if a is not None]
        self.nbytes = sum(a.nbytes for a in params)

    @staticmethod
    def is_encoder_dir(path: Path) -> bool:
        """Whether ``path`` holds an encoder this module runs (by config.json's model_type)."""
        try:
            config = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(config, dict) and config.get("model_type") in _FAMILIES

    @classmethod
    def load(cls, path: Path) -> EncoderModel:
        path = Path(path)
        config = _read_json(path / "config.json")
        if not isinstance(config, dict) or config.get("model_type") not in _FAMILIES:
            raise ModelLoadError(f"{path}: not an encoder folder (config.json model_type one of {sorted(_FAMILIES)})")
        family = _FAMILIES[config["model_type"]]
        modules = _read_json(path / "modules.json") or [{"type": _ST + "Transformer", "path": ""},
                                                          {"type": _ST + "Pooling", "path": ""}]
        pooling, dense, normalize, transformer_dir = None, [], False, path
        for module in modules:
            kind, sub = module.get("type", ""), path / module.get("path", "")
            if kind.endswith(".Transformer"):
                transformer_dir = sub
            elif kind.endswith(".Pooling"):
                pooling = _read_json(sub / "config.json") if module.get("path") else None
            elif kind.endswith(".Dense"):
                dense.append(_Dense.load(sub))
            elif kind.endswith(".Normalize"):
                normalize = True
            else:
                raise ModelLoadError(f"{path}: sentence-transformers module {kind!r} is not supported")
        try:
            args = family.ModelArgs.from_config(config)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}/config.json: {e}") from e
        encoder = family.Model(args)
        try:
            encoder.load_weights(list(family.sanitize(_read_safetensors(transformer_dir), args).items()))
        except ValueError as e:
            raise ModelLoadError(
                f"{transformer_dir}: weights do not fit the {config['model_type']} config ({e})") from e
        # float32 on every device: these models are tens to hundreds of MB, and half precision would
        # loosen the parity with sentence-transformers that the tests hold them to.
        encoder.set_dtype(mx.float32)
        encoder.eval()
        mx.eval(encoder.parameters())
        st = _read_json(transformer_dir / "sentence_bert_config.json") or {}
        max_length = min(st.get("max_seq_length") or args.max_positions, args.max_positions)
        return cls(encoder, _pooling_modes(pooling), dense, normalize, max_length, args.vocab_size,
                   args.pad_token_id, _sep_token_id(path, config), args.hidden_size)

    def embed(self, token_ids: list[list[int]]) -> np.ndarray:
        """Token id lists (with the tokenizer's special tokens) -> [n, dim] float32 sentence embeddings.

        Inputs longer than ``max_length`` are cut as the tokenizer's truncation would: the head is
        kept and a closing separator token stays last. Ids outside the vocabulary and empty inputs
        raise InvalidRequestError.
        """
        rows = [self._check_and_truncate(i, ids) for i, ids in enumerate(token_ids)]
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        for chunk in _length_chunks([len(rows[i]) for i in order]):
            picked = order[chunk]
            out[picked] = self._forward([rows[i] for i in picked])
        return out

    def _check_and_truncate(self, i: int, ids: list[int]) -> list[int]:
        if len(ids) == 0:
            raise InvalidRequestError(f"input {i} is empty", param="input")
        if min(ids) < 0 or max(ids) >= self._vocab_size:
            raise InvalidRequestError(f"input {i} has a token id outside the vocabulary [0, {self._vocab_size})",
                                      param="input")
        if len(ids) <= self.max_length:
            return list(ids)
        if self._sep_id is not None and ids[-1] == self._sep_id:
            return list(ids[: self.max_length - 1]) + [ids[-1]]
        return list(ids[: self.max_length])

    def _forward(self, rows: list[list[int]]) -> np.ndarray:
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self._pad_id, dtype=np.int32)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = r
        lengths = mx.array([len(r) for r in rows])
        mask = mx.arange(width)[None] < lengths[:, None]
        hidden = self._encoder(mx.array(ids), mask)
        vec = _pool(hidden, mask, lengths, self._modes)
        for d in self._dense:
            vec = d(vec)
        if self._normalize:
            vec = vec / mx.maximum(mx.linalg.norm(vec, axis=-1, keepdims=True), 1e-12)
        return np.array(vec.astype(mx.float32))


def _length_chunks(lengths: list[int]) -> list[slice]:
    """Cut ascending ``lengths`` into runs padded to their last (longest) one: each at most
    ``TOKENS_PER_FORWARD`` padded tokens and at most ``MAX_PADDING`` of its real tokens in padding."""
    chunks, start, real = [], 0, 0
    for i, n in enumerate(lengths):
        padded = (i + 1 - start) * n
        if i > start and (padded > TOKENS_PER_FORWARD or padded > (real + n) * (1 + MAX_PADDING)):
            chunks.append(slice(start, i))
            start, real = i, 0
        real += n
    chunks.append(slice(start, len(lengths)))
    return chunks


def _sep_token_id(path: Path, config: dict) -> int | None:
    """The separator/end token that closes every tokenized input (kept last when truncating), if known."""
    specials = _read_json(path / "special_tokens_map.json") or _read_json(path / "tokenizer_config.json") or {}
    name = specials.get("sep_token") or specials.get("eos_token")
    if isinstance(name, dict):
        name = name.get("content")
    tok = _read_json(path / "tokenizer.json")
    if name and isinstance(tok, dict):
        vocab = (tok.get("model") or {}).get("vocab")
        found = None
        if isinstance(vocab, dict):
            found = vocab.get(name)
        for added in tok.get("added_tokens") or []:
            if added.get("content") == name:
                found = added.get("id")
        if found is not None:
            return int(found)
    sep = config.get("sep_token_id", config.get("eos_token_id"))
    return sep if isinstance(sep, int) else None
