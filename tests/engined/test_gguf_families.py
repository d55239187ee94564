"""GGUF round trips per family and per quant type: the file's weights give the same logits as safetensors.

Families: qwen3, qwen3moe, qwen3next, qwen35, qwen35moe, gemma3, gemma4 (the
E-series layout and the MoE one) and gpt-oss; each also through mlxd's
engine step.

Each case writes a tiny random model as llama.cpp's converter would
(tests/gguf_convert.py: names from gguf's own tensor map, the converter's
layout changes, quantized with gguf.quants or tests/gguf_kquants.py for the
K-quants gguf cannot write), loads it through mlxd's loader, and compares
with mlx_lm's model of the same directory holding the weights the file holds
(``roundtrip``: quantized and dequantized by the gguf package).

- dense float32 (the CPU policy): equal logits, bit for bit, for every type.
- kept quantized (the GPU policy; the loader's output before the dtype
  policy lowers dense tensors): the MLX bits per layer, and logits at
  float32 compute within 5e-4 for the exact types (Q4_0, Q4_1, Q5_0, Q5_1,
  Q8_0, MXFP4: summation order only, measured ~2e-5); Q4_K/Q5_K (scales
  rounded once to float16) and Q6_K (re-quantized to 8 bits) within the
  fractions of the file's own quantization error stated below.

Over 400 lines because every family's round trip shares the writer, the oracle and the tolerances
above; split by family, each file would repeat them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlxd.engined.loaders import load_model
from mlxd.engined.loaders.gguf import load_gguf
from mlxd.engined.loaders.gguf_quant import dense, quantized, unpack
from mlxd.shared.errors import ModelLoadError
from tests.gguf_convert import FAMILIES, QTYPES, make_family_model, roundtrip, write_family_gguf
from tests.gguf_kquants import ENCODERS
from tests.tiny_models import fresh_seed

TOKENS = mx.array([[264, 5, 72, 101, 108, 256, 111, 32, 199, 3, 64, 265]])
# gpt-oss as its real GGUF files are: experts in MXFP4, the rest Q8_0.
GPT_OSS_MIXED = {"mlp.experts.": "MXFP4", "": "Q8_0"}
MLX_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 8}
# Lossy representations: max |logit difference| kept-quantized vs the file's values, at most
# this fraction of the difference the file's own quantization makes (file vs float weights).
# Q4_K/Q5_K: each sub-block's scale and min rounded to float16; measured 1-3% over 8 seeds.
# Q6_K: re-quantized to MLX 8-bit per 32 (error <= range / 510); measured 20-35% over 8 seeds,
# once above 50%.
KEPT_RATIO = {"Q4_K": 0.1, "Q5_K": 0.1, "Q6_K": 0.75}
# Exact types, kept quantized: only summation order differs (quantized vs dense matmul);
# measured 2e-5 typically, 1.1e-4 at worst (Gemma 4, logits up to its soft cap of 30).
EXACT_ATOL = 5e-4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    seed = fresh_seed("gguf families")
    root = tmp_path_factory.mktemp("families")
    return {f: make_family_model(root / f, f, seed=seed) for f in (*FAMILIES, "gemma4_moe")}


@pytest.fixture(scope="module")
def gguf_file(family_dirs, tmp_path_factory):
    """(family, qtype) -> a GGUF file of it, written once and shared by the tests of this module."""
    root, files = tmp_path_factory.mktemp("gguf"), {}

    def get(family: str, qtype) -> str:
        key = (family, str(qtype))
        if key not in files:
            files[key] = str(write_family_gguf(family_dirs[family], root / f"{family}-{len(files)}.gguf", qtype))
        return files[key]

    return get


_REFERENCE: dict[str, mx.array] = {}


def _reference_logits(model_dir, path) -> mx.array:
    """mlx_lm's logits with the weights the file holds (cached per file: files are shared by tests)."""
    if str(path) not in _REFERENCE:
        reference, _ = mlx_lm_load_model(model_dir)
        reference.load_weights([(k, mx.array(v)) for k, v in roundtrip(model_dir, path).items()])
        _REFERENCE[str(path)] = reference(TOKENS)
    return _REFERENCE[str(path)]


def _bits(model: nn.Module) -> dict[str, int]:
    return {
        name: m.bits
        for name, m in model.named_modules()
        if hasattr(m, "bits") and hasattr(m, "scales")
    }


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_dense_float32_logits_equal_safetensors(family_dirs, gguf_file, family, qtype):
    path = gguf_file(family, qtype)
    loaded = load_model(path, dtype="float32")
    assert loaded.model_type == family
    assert _bits(loaded.model) == {}
    np.testing.assert_array_equal(np.array(loaded.model(TOKENS)), np.array(_reference_logits(family_dirs[family], path)))


@pytest.mark.parametrize("qtype", ["BF16", "Q8_0", "Q4_K"])
def test_gguf_gemma4_moe_logits_equal_safetensors(family_dirs, gguf_file, qtype):
    # Gemma 4's MoE layout: router scales stored as ".scale" tensors, experts' gate and up
    # fused, K = V on the global layers; dense float32 and kept quantized.
    path = gguf_file("gemma4_moe", qtype)
    want = _reference_logits(family_dirs["gemma4_moe"], path)
    loaded = load_model(path, dtype="float32")
    assert loaded.model.args.enable_moe_block and loaded.model.args.attention_k_eq_v
    np.testing.assert_array_equal(np.array(loaded.model(TOKENS)), np.array(want))
    if qtype == "Q8_0":
        model = _kept(path)
        assert _bits(model)["model.layers.0.experts.switch_glu.gate_proj"] == 8
        np.testing.assert_allclose(np.array(model(TOKENS)), np.array(want), rtol=0, atol=EXACT_ATOL)


def test_gpt_oss_mxfp4_experts_dense_logits_equal_safetensors(family_dirs, gguf_file):
    path = gguf_file("gpt_oss", GPT_OSS_MIXED)
    loaded = load_model(path, dtype="float32")
    np.testing.assert_array_equal(np.array(loaded.model(TOKENS)), np.array(_reference_logits(family_dirs["gpt_oss"], path)))


def _kept(path) -> nn.Module:
    # The loader's own output (quantized layers, float16 scales, float32 dense tensors), before
    # the dtype policy lowers the dense tensors: float32 compute, so that only the weights'
    # representation differs from the reference.
    model = load_gguf(path, keep_quantized=True).model
    model.set_dtype(mx.float32)  # scales: float16 -> float32 is exact
    return model


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_kept_quantized_bits_and_logits_per_quant_type(family_dirs, gguf_file, qtype):
    # Qwen3.5: attention and gated delta net (its tiled value heads moved in whole quantization
    # groups). Dense, because an MoE's top-k routing turns a tiny weight difference into a jump
    # in its logits when two experts' scores are close: lossy types are compared without it.
    path = gguf_file("qwen3_5", qtype)
    model = _kept(path)
    bits = _bits(model)
    layer = "language_model.model.layers.0"
    if qtype in MLX_BITS:
        assert bits[f"{layer}.linear_attn.in_proj_qkv"] == MLX_BITS[qtype]
        assert bits[f"{layer}.linear_attn.out_proj"] == MLX_BITS[qtype]
        assert bits[f"{layer}.mlp.gate_proj"] == MLX_BITS[qtype]
        assert bits["language_model.model.embed_tokens"] == MLX_BITS[qtype]
    else:
        assert bits == {}
    got, want = np.array(model(TOKENS)), np.array(_reference_logits(family_dirs["qwen3_5"], path))
    original, _ = mlx_lm_load_model(family_dirs["qwen3_5"])
    file_error = np.abs(want - np.array(original(TOKENS))).max()
    kept_error = np.abs(got - want).max()
    print(f"{qtype}: kept vs file {kept_error:.2e}, file vs float {file_error:.2e}")
    if qtype in KEPT_RATIO:
        assert kept_error <= KEPT_RATIO[qtype] * file_error
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=EXACT_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_kept_quantized_logits_per_family(family_dirs, gguf_file, family):
    path = gguf_file(family, "Q5_0")
    model = _kept(path)
    assert set(_bits(model).values()) == {5}
    got, want = np.array(model(TOKENS)), np.array(_reference_logits(family_dirs[family], path))
    np.testing.assert_allclose(got, want, rtol=0, atol=EXACT_ATOL)


def test_gguf_kept_quantized_dtype_policy(family_dirs, gguf_file):
    # What a GPU runs (dtype "auto" there, "quantized" here): dense tensors at the file's
    # precision (float16 for a quantized file), except what the family keeps in float32.
    model = load_model(gguf_file("qwen3_5", "Q5_0"), dtype="quantized").model
    layer = model.language_model.model.layers[0]
    assert layer.linear_attn.in_proj_qkv.scales.dtype == mx.float16
    assert layer.input_layernorm.weight.dtype == mx.float16
    assert layer.linear_attn.A_log.dtype == mx.float32  # mlx_lm's cast_predicate
    bf16 = load_model(gguf_file("qwen3", "BF16"), dtype="quantized").model
    assert {p.dtype for _, p in tree_flatten(bf16.parameters())} == {mx.bfloat16}


def test_gguf_kept_mixed_bits_join_and_mxfp4(family_dirs, gguf_file):
    # Qwen3-Next's in_proj_qkvz is joined from two GGUF tensors: here of different widths.
    path = gguf_file("qwen3_next", {"in_proj_z": "Q8_0", "": "Q4_0"})
    model = _kept(path)
    assert _bits(model)["model.layers.0.linear_attn.in_proj_qkvz"] == 8
    want = _reference_logits(family_dirs["qwen3_next"], path)
    np.testing.assert_allclose(np.array(model(TOKENS)), np.array(want), rtol=0, atol=EXACT_ATOL)

    path = gguf_file("gpt_oss", GPT_OSS_MIXED)
    model = _kept(path)
    experts = model.model.layers[0].mlp.experts.gate_proj
    assert (experts.mode, experts.bits) == ("mxfp4", 4)
    want = _reference_logits(family_dirs["gpt_oss"], path)
    np.testing.assert_allclose(np.array(model(TOKENS)), np.array(want), rtol=0, atol=EXACT_ATOL)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "gpt_oss"])
def test_gguf_fused_gate_up_experts_and_mtp_blocks(family_dirs, gguf_file, tmp_path, family):
    # Real Qwen3.5 files count their multi-token-prediction block in block_count, and the
    # converter can fuse the experts' gate and up: neither changes the model, whose weights
    # are those of the plain file (rows are quantized one by one, so fusing moves no value).
    path = write_family_gguf(family_dirs[family], tmp_path / "f.gguf", "Q8_0", fuse_gate_up=True, mtp=True)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.num_layers == 2
    want = _reference_logits(family_dirs[family], gguf_file(family, "Q8_0"))
    np.testing.assert_array_equal(np.array(loaded.model(TOKENS)), np.array(want))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_quant_blocks_become_mlx_quantized_weights(qtype):
    # At float32 scales the MLX weights hold exactly the values gguf dequantizes to, except
    # Q6_K, which MLX has no 16-wide group for and is re-quantized to 8 bits.
    rng = np.random.default_rng(seed := fresh_seed(qtype))
    x = rng.standard_normal((3, 512)).astype(np.float32) * rng.uniform(0.01, 3.0, (3, 1)).astype(np.float32)
    kind = GGMLQuantizationType[qtype]
    data = ENCODERS[qtype](x) if qtype in ENCODERS else quants.quantize(x, kind)
    want = dense(data, kind, x.shape)
    got = unpack(quantized(data, kind, x.shape))
    if qtype == "Q6_K":
        groups = want.reshape(3, -1, 32)
        half_step = (groups.max(-1) - groups.min(-1)) / 510
        assert (np.abs(got - want).reshape(3, -1, 32).max(-1) <= half_step * (1 + 1e-4)).all(), seed  # float32 rounding
    else:
        np.testing.assert_array_equal(got, want)


def test_unknown_gguf_architecture_is_refused_naming_the_supported_ones(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'mamba' is not supported \(supported: .*gemma3.*gpt-oss.*qwen35moe"):
        load_model(str(path))


@pytest.mark.parametrize(
    "family, undo",
    [
        ("qwen3_5", "_untile"),  # value heads back from llama.cpp's tiled order
        ("qwen3_next", "_qkvz_order"),  # the per-key-head [q k v z] interleave
        ("gemma3_text", "_shift"),  # norms stored as 1 + w
    ],
)
def test_each_layout_fix_is_what_makes_parity(family_dirs, gguf_file, monkeypatch, family, undo):
    # Reading the same file without one of the loader's layout fixes must disagree, or the
    # round trips above would not prove that fix.
    from mlxd.engined.loaders import gguf_arch

    path = gguf_file(family, "F32")
    good = np.array(load_model(path, dtype="float32").model(TOKENS))
    skip = {
        "_untile": lambda n, k_heads, per, width: np.arange(n),
        "_qkvz_order": lambda nk, dk, nv, dv: np.arange(2 * nk * dk + nv * dv + nv * dv),
        "_shift": lambda family, value: value,
    }[undo]
    monkeypatch.setattr(gguf_arch, undo, skip)
    bad = np.array(load_model(path, dtype="float32").model(TOKENS))
    assert np.abs(good - bad).max() > 0.1


@pytest.mark.parametrize(
    "pre, text, pieces",
    [
        # Qwen3.5 keeps combining marks inside the word; Qwen2's pattern splits them off.
        ("qwen35", "cafe\u0301 ok", ["cafe\u0301", " ok"]),
        ("qwen2", "cafe\u0301 ok", ["cafe", "\u0301", " ok"]),
        # o200k (gpt-oss): words split at case changes, digits in threes.
        ("gpt-4o", "HelloWorld 12345", ["Hello", "World", " ", "123", "45"]),
    ],
)
def test_gguf_pre_tokenizers_of_the_new_families(tmp_path, pre, text, pieces):
    from tokenizers import Tokenizer

    from mlxd.engined.loaders.gguf_tokenizer import build_tokenizer_dir
    from tests.tiny_models import byte_chars, tiny_vocab

    tokens, merges, _ = tiny_vocab(272)
    (tmp_path / "x.gguf").write_bytes(b"")  # the cache key's file
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
    }
    tok = Tokenizer.from_file(str(build_tokenizer_dir(meta, tmp_path / "x.gguf") / "tokenizer.json"))
    got = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
    chars = byte_chars()  # pieces come back in GPT-2's byte-level alphabet
    assert got == ["".join(chars[b] for b in piece.encode()) for piece in pieces]


def test_gguf_gemma4_tokenizer_uses_the_files_merges(tmp_path):
    # Gemma 4's vocabulary is SentencePiece pieces whose merges the file stores (tokenizer model
    # "gemma4", no space prefix): without the "▁t he" merge "the" stays two pieces, whatever
    # the scores say.
    from transformers import AutoTokenizer

    from mlxd.engined.loaders.gguf_tokenizer import build_tokenizer_dir
    from tests.tiny_models import tiny_spm_vocab

    tokens, scores, types = tiny_spm_vocab(272)
    ids = {t: i for i, t in enumerate(tokens)}
    (tmp_path / "g.gguf").write_bytes(b"")  # the cache key's file
    meta = {
        "general.architecture": "gemma4",
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["▁ t", "h e", "a t", "▁ c", "▁c at"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": False,
    }
    tok = AutoTokenizer.from_pretrained(str(build_tokenizer_dir(meta, tmp_path / "g.gguf")))
    assert tok.encode(" the cat", add_special_tokens=False) == [ids["▁t"], ids["he"], ids["▁cat"]]
    assert tok.encode("hat€")[:3] == [ids["<s>"], ids["h"], ids["at"]]  # BOS by default, bytes for €
    assert tok.decode(tok.encode(" the cat hat€"), skip_special_tokens=True) == " the cat hat€"


@pytest.mark.parametrize("family", [*FAMILIES, "gemma4_moe"])
def test_gguf_family_runs_through_the_engine_step(family_dirs, gguf_file, family):
    # The loaded GGUF model through mlxd's own path (paged attention, slotted linear attention,
    # shared-layer K/V, a mixed decode/chunked/fresh-prefill step) gives mlx_lm's logits for
    # the file's weights.
    from tests.engined.test_parity import check_parity

    path = gguf_file(family, "Q4_K")
    reference, _ = mlx_lm_load_model(family_dirs[family])
    reference.load_weights([(k, mx.array(v)) for k, v in roundtrip(family_dirs[family], path).items()])
    check_parity(load_model(path), reference, vocab=272, block_size=8)


def _reference_read(path: str) -> tuple[dict, dict]:
    """The gguf package's own reader: metadata values and tensors, as mlxd's loader used to take them."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    return meta, {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_read_gguf_gives_what_the_gguf_packages_reader_gives(gguf_file, qtype):
    """Every metadata value and every tensor's bytes, type and shape, on files of several types (and the
    embedded SmolLM2 with its 49K-token vocabulary), equal gguf.GGUFReader's."""
    from mlxd.engined.loaders import default_model_path
    from mlxd.engined.loaders.gguf import read_gguf

    for path in [gguf_file("qwen3", qtype)] + ([default_model_path()] if qtype == "Q4_1" else []):
        meta, tensors = read_gguf(path)
        want_meta, want_tensors = _reference_read(path)
        assert meta == want_meta
        assert list(tensors) == list(want_tensors)
        for name, t in tensors.items():
            ref = want_tensors[name]
            assert t.tensor_type == GGMLQuantizationType(int(ref.tensor_type))
            assert t.shape == tuple(int(d) for d in reversed(ref.shape.tolist()))
            assert t.data.dtype == ref.data.dtype and t.data.shape == ref.data.shape
            assert np.array_equal(t.data.view(np.uint8), ref.data.view(np.uint8))


def test_every_cut_and_byte_flip_of_a_gguf_header_raises_model_load_error_or_reads(gguf_file, tmp_path):
    """A truncated or corrupted header or tensor table is a ModelLoadError, never another exception or a
    crash: every cut inside the header and table, and seeded random byte flips in it."""
    from mlxd.engined.loaders.gguf import read_gguf

    path = gguf_file("qwen3", "Q8_0")
    data = open(path, "rb").read()
    first = min(t.data_offset for t in _reference_read(path)[1].values())  # where the tensor data begins
    probe = tmp_path / "probe.gguf"

    def outcome(blob: bytes) -> str:
        probe.write_bytes(blob)
        try:
            read_gguf(str(probe))
        except ModelLoadError:
            return "refused"
        return "read"

    cuts = sorted(set(np.linspace(0, first - 1, 400).astype(int).tolist()))
    assert {outcome(data[:cut]) for cut in cuts} == {"refused"}
    seed = fresh_seed("gguf byte flips")
    rng = np.random.default_rng(seed)
    seen = set()
    for _ in range(300):
        blob = bytearray(data)
        for at in rng.integers(0, first, rng.integers(1, 4)):
            blob[at] = int(rng.integers(0, 256))
        seen.add(outcome(bytes(blob)))
    assert seen == {"refused", "read"}
