"""Tiny random-weight models for tests: mlx_lm/HF directories and GGUF files of the same weights.

``make_tiny_model(dir, arch)`` writes config.json, model.safetensors and a
small byte-level BPE tokenizer (with a ChatML template) in Hugging Face
layout; ``write_tiny_gguf(model_dir, path, qtype)`` writes the same weights as
a llama.cpp GGUF file the way llama.cpp's converter would (tensor names, Q/K
row permutation for llama, F32 norms, 2-D weights in ``qtype``);
``gguf_roundtrip_weights`` gives the weights as they come back out of that
quantization, for parity checks. Everything is deterministic in ``seed``.
``seeded_rng`` prints the seeds of random tests; ``assert_greedy_equal_up_to_ties`` compares
greedy outputs of differently packed steps.

Over 400 lines because each family's config and GGUF layout is a few lines, and all of them share the
writer, the tokenizer and the seeds; split by family, each would repeat them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3")


def quantize_in_groups_of_32(model, bits: int = 4) -> None:
    """Quantize (in place) every linear layer, expert bank and embedding whose rows split into groups of 32."""
    import mlx.nn as nn

    nn.quantize(model, group_size=32, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)


def fresh_seed(label: str = "rng") -> int:
    """A new seed each run, printed (pytest shows it with a failure): pass it back to replay the run."""
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"{label} seed {seed}")
    return seed


def seeded_rng(seed: int | None = None) -> np.random.Generator:
    """A numpy generator on ``seed``, or on a fresh printed one (``fresh_seed``)."""
    return np.random.default_rng(fresh_seed() if seed is None else seed)


# Packed steps of different shapes sum in different orders: float32 logits may differ in the last bits.
TIE = 1e-4


def assert_greedy_equal_up_to_ties(model, prompts: list[list[int]], got: list[list[int]],
                                   expected: list[list[int]]) -> None:
    """Each of ``got`` is ``expected``, or first parts from it where ``model``'s own forward over the
    shared prefix puts both tokens within ``TIE`` (relative to the largest logit) of its greedy choice;
    what follows a tie is the other branch's and is not compared."""
    import mlx.core as mx

    for i, (prompt, g, e) in enumerate(zip(prompts, got, expected)):
        j = next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), None)
        if j is None:
            assert len(g) == len(e), (i, g, e)
            continue
        logits = np.asarray(model(mx.array([prompt + e[:j]]))[0, -1].astype(mx.float32))
        top, margin = logits.max(), TIE * max(1.0, float(np.abs(logits).max()))
        assert top - logits[g[j]] <= margin and top - logits[e[j]] <= margin, (
            f"request {i} leaves the greedy path at token {j}: {g[j]} for {e[j]}, logits "
            f"{logits[g[j]]:.6f} and {logits[e[j]]:.6f}, the best {top:.6f}")
        print(f"request {i}: a tie at token {j} ({g[j]}, {e[j]}: {logits[g[j]]:.7f}, {logits[e[j]]:.7f})")


QTYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")

_BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": 272,
    "max_position_embeddings": 2048,
    "bos_token_id": 256 + 8,
    "eos_token_id": 256 + 8 + 2,
}
_ARCH_QWEN3_5_TEXT = {
    "num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
    "rope_parameters": {"type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
}
_ARCH = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0, "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rope_theta": 1000000.0, "tie_word_embeddings": True},
    # Mixture of experts: layer 0 routes 2 of 4 experts, layer 1 is a dense MLP.
    "qwen3_moe": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], "moe_intermediate_size": 32, "norm_topk_prob": True,
    },
    # MoE with attention sinks; layer 0 slides over 12 tokens (not a multiple of any block size), layer 1 is global.
    "gpt_oss": {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "rope_theta": 150000,
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 12,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # Gemma 3 text: sliding and global layers with their own RoPE bases, q/k norms, a query scale
    # that is not head_dim ** -0.5.
    "gemma3_text": {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 24, "sliding_window": 12,
        "sliding_window_pattern": 2,
    },
    # Hybrids: gated delta nets (layers 0 and 2) and gated full attention with partial RoPE (1 and 3);
    # MoE with a shared expert.
    "qwen3_next": {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4,
        "full_attention_interval": 2, "rope_theta": 1000000.0, "partial_rotary_factor": 0.5,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "tie_word_embeddings": False,
    },
    "qwen3_5": {
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "num_hidden_layers": 4,
        "full_attention_interval": 2, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        "rope_parameters": {"type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    },
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "num_hidden_layers": 4,
        "full_attention_interval": 2, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "rope_parameters": {"type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    },
    # Qwen3.5 as its vision-language checkpoints store it: the same text model under text_config.
    "qwen3_5_vl": {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                   "text_config": {"model_type": "qwen3_5_text", **_ARCH_QWEN3_5_TEXT}},
    "qwen3_5_moe_vl": {
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": {"model_type": "qwen3_5_moe_text", **_ARCH_QWEN3_5_TEXT, "num_experts": 4,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    },
    # Mistral spells Llama's config (mlx_lm maps it to llama); a sliding window no layer uses in mlx_lm.
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "rope_theta": 1000000.0,
                "tie_word_embeddings": False},
    # Ministral 3: sliding + full layers, YaRN RoPE and a position-dependent query scale (Llama 4's).
    "ministral3": {
        "model_type": "ministral3", "architectures": ["Ministral3ForCausalLM"], "tie_word_embeddings": False,
        "sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
    },
    # The vision-language checkpoint layouts: the text model under `language_model`, its config in text_config.
    "mistral3": {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
                 "text_config": {"model_type": "mistral", "rope_theta": 1000000.0}},
    "mistral3_ministral3": {
        "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": {
            "model_type": "ministral3", "sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
        },
    },
    "idefics3": {"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"],
                 "text_config": {"model_type": "llama", "rope_theta": 100000.0}},
    # Qwen2.5-VL: a Qwen2 whose RoPE frequencies are cut into time, height and width sections (M-RoPE).
    "qwen2_5_vl": {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                   "rope_theta": 1000000.0, "tie_word_embeddings": True,
                   "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
    "mixtral": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "rope_theta": 1000000.0,
                "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    # Phi-3.5 / Phi-4-mini: fused qkv and gate_up projections, partial RoPE with LongRoPE scaling.
    "phi3": {
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 512,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(4)],
                         "long_factor": [1.5 + 0.2 * i for i in range(4)]},
    },
    # GLM-4: partial interleaved RoPE, q/k/v bias, fused gate_up, extra post-norms.
    "glm4": {"model_type": "glm4", "architectures": ["Glm4ForCausalLM"], "attention_bias": True,
             "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
    # GLM-4.5: layer 0 dense, layer 1 sigmoid-routed experts + a shared expert; per-head q/k norms.
    "glm4_moe": {
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "moe_intermediate_size": 32,
        "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 4,
        "routed_scaling_factor": 2.5, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "rope_theta": 1000000.0,
        "rope_scaling": None, "use_qk_norm": True, "tie_word_embeddings": False, "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
    # OLMo 2: q/k norms over the whole projection (all heads at once), norms after attention and MLP.
    "olmo2": {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "rope_theta": 500000.0,
              "tie_word_embeddings": False},
    # Gemma 2: attention logit soft cap, final logit soft cap, query scale from query_pre_attn_scalar.
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 24},
    # SmolLM3: Llama with RoPE left out of every fourth layer (here layer 1 of 2: interval 2).
    "smollm3": {"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "rope_theta": 5000000.0,
                "no_rope_layer_interval": 2, "tie_word_embeddings": True},
    # Gemma 3 as its vision-language checkpoints store it: gemma3 wrapping gemma3_text.
    "gemma3": {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": {"model_type": "gemma3_text", "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                               "query_pre_attn_scalar": 24, "sliding_window": 12, "sliding_window_pattern": 2}},
    # Gemma 4 text (26B/31B layout): layers 2-3 read layers 0-1's K/V; global layers have their own
    # head size, fewer K/V heads and K = V; sliding layers a window of 12; MoE beside the dense MLP.
    "gemma4_text": {
        "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 4,
        "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 0, "sliding_window": 12,
        "sliding_window_pattern": 2, "final_logit_softcapping": 30.0, "enable_moe_block": True,
        "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
    },
    # Gemma 4 E2B/E4B layout: the wrapper, per-layer input embeddings, KV shared by the last two
    # layers, double-wide MLPs there, proportional partial RoPE on the global layers.
    "gemma4": {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": {
            "model_type": "gemma4_text", "num_hidden_layers": 4, "global_head_dim": 32, "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 272, "sliding_window": 12,
            "sliding_window_pattern": 2, "final_logit_softcapping": 30.0, "use_double_wide_mlp": True,
        },
    },
}

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("Ġ", "a")]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte value 0..255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[tuple[str, str]], list[bool]]:
    """(tokens, merges, is_special): 256 bytes, merged pieces, ChatML specials, reserved specials."""
    tokens = byte_chars() + ["".join(m) for m in _MERGES] + _SPECIALS
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size must be at least {len(tokens)}")
    tokens += [f"<|reserved_{i}|>" for i in range(vocab_size - len(tokens))]
    special = [i >= 256 + len(_MERGES) for i in range(len(tokens))]
    return tokens, list(_MERGES), special


def tiny_spm_vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece-style vocabulary with byte fallback.

    <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF>, then pieces whose
    scores make "▁the" and "▁cat" whole words and leave other text to single
    pieces or bytes; reserved control tokens fill up to ``vocab_size``.
    """
    pieces = {"▁t": -1.0, "he": -2.0, "▁the": -3.0, "at": -4.0, "▁c": -5.0, "▁cat": -6.0}
    singles = ["▁", "t", "h", "e", "c", "a", "s"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + singles + list(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-100.0 - i for i in range(len(singles))] + list(pieces.values())
    types = [2, 3, 3] + [6] * 256 + [1] * (len(singles) + len(pieces))
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size must be at least {len(tokens)}")
    for i in range(vocab_size - len(tokens)):
        tokens.append(f"<reserved_{i}>")
        scores.append(0.0)
        types.append(3)
    return tokens, scores, types


def _write_tokenizer(out: Path, config: dict) -> None:
    tokens, merges, special = tiny_vocab(config["vocab_size"])
    write_tokenizer(out, tokens, merges, special, tokens[config["bos_token_id"]], tokens[config["eos_token_id"]],
                    config["max_position_embeddings"])


def write_tokenizer(out: Path, tokens: list[str], merges: list[tuple[str, str]], special: list[bool], bos: str,
                    eos: str, context: int) -> None:
    """A byte-level BPE tokenizer with the ChatML template, in Hugging Face's files: ``tokens`` in id
    order (``special[i]``: token i is an added special token), ``bos`` also the pad token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, s in zip(tokens, special) if s])
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": bos,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def tiny_config(arch: str, **overrides) -> dict:
    """config.json of a tiny ``arch``; a wrapped layout (an entry with ``text_config``) gets the tiny
    sizes in its text_config, and the tokenizer's ids and sizes at the top too."""
    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {sorted(_ARCH)}")
    entry = dict(_ARCH[arch])
    if "text_config" not in entry:
        return {**_BASE, **entry, **overrides}
    text = {**_BASE, **entry.pop("text_config")}
    text.update({k: v for k, v in overrides.items() if k in _BASE})
    top = {k: _BASE[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "max_position_embeddings")}
    return {**top, **entry, **overrides, "text_config": text}


def _random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 weights for the shapes mlx_lm's model of ``config`` has."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlxd.engined.loaders.mlx_dir import model_classes

    model_class, args_class = model_classes(config)
    shapes = {k: v.shape for k, v in tree_flatten(model_class(args_class.from_dict(config)).parameters())}
    del mx  # only the shapes are needed; values come from numpy for reproducibility
    rng = np.random.default_rng(seed)
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            # Not all ones, so that a norm applied to the wrong tensor shows.
            w = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif name.endswith("sinks"):
            w = rng.standard_normal(shape)  # logits of the order of the attention scores
        elif "embed_tokens" in name or "lm_head" in name:
            w = 0.3 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        weights[name] = w.astype(np.float32)
    return weights


# Families whose checkpoints carry a multi-token-prediction layer, and the config key counting them.
MTP_ARCHS = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers",
             "qwen3_5_moe": "mtp_num_hidden_layers", "glm4_moe": "num_nextn_predict_layers"}


def _mtp_weights(config: dict, weights: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """The MTP tensors a checkpoint of the family carries (in the layout of the rest): the two norms
    before the projection of [embedding | hidden] (``fc`` [hidden, 2 hidden]), one decoder layer
    shaped as the model's own full-attention (Qwen) or last (GLM) layer, and the final norm.

    Qwen3-Next / Qwen3.5: ``mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,layers.0.*,norm}``.
    GLM-4.5 (DeepSeek-V3's layout): layer ``num_hidden_layers`` of the model,
    ``model.layers.N.{enorm,hnorm,eh_proj,<decoder layer>,shared_head.norm}`` with copies of the
    embedding and head (``embed_tokens``, ``shared_head.head``).
    """
    text = config.get("text_config", config)
    hidden = text["hidden_size"]
    rng = np.random.default_rng(seed + 1)  # the model's own weights stay those of ``seed``
    glm = config["model_type"] == "glm4_moe"
    n = text["num_hidden_layers"]
    layer = f"model.layers.{n - 1 if glm else text['full_attention_interval'] - 1}."
    at = f"model.layers.{n}." if glm else "mtp.layers.0."
    names = (("enorm", "hnorm", "eh_proj", "shared_head.norm") if glm
             else ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"))
    out = {}
    for name, w in weights.items():
        if layer in name:
            out[at + name.split(layer, 1)[1]] = (
                1.0 + 0.2 * rng.standard_normal(w.shape) if name.endswith("norm.weight")
                else rng.standard_normal(w.shape) / np.sqrt(w.shape[-1])).astype(np.float32)
    prefix = f"model.layers.{n}." if glm else "mtp."
    for norm in (names[0], names[1], names[3]):
        out[f"{prefix}{norm}.weight"] = (1.0 + 0.2 * rng.standard_normal(hidden)).astype(np.float32)
    fc = rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(2 * hidden)
    out[f"{prefix}{names[2]}.weight"] = fc.astype(np.float32)
    if glm:
        out[f"{prefix}embed_tokens.weight"] = weights["model.embed_tokens.weight"]
        out[f"{prefix}shared_head.head.weight"] = weights["lm_head.weight"]
    return out


def make_tiny_model(directory, arch: str = "llama", seed: int = 0, mtp: bool = False, **overrides) -> Path:
    """Write a tiny random-weight mlx_lm/HF model directory; returns its path.

    Defaults: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, FFN 128, vocab
    272 (256 bytes, 8 merges, <|endoftext|> <|im_start|> <|im_end|>,
    reserved). ``overrides`` replace config.json entries. ``mtp`` (an arch of
    ``MTP_ARCHS``) adds the checkpoint's multi-token-prediction layer.
    """
    import mlx.core as mx

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    weights = _random_weights(config, seed)
    if mtp:
        (config["text_config"] if "text_config" in config else config)[MTP_ARCHS[config["model_type"]]] = 1
        weights.update(_mtp_weights(config, weights, seed))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}, metadata={"format": "mlx"})
    _write_tokenizer(out, config)
    return out



def make_tiny_gemma4_assistant(directory, target_dir, seed: int = 0, ordered: bool = False, **overrides) -> Path:
    """Write a tiny random-weight Gemma 4 assistant (``gemma4_assistant``) for the Gemma 4 model in
    ``target_dir``, as Hugging Face stores one (float32 safetensors, transformers' names); its path.

    Two layers, sliding then full attention, of width 32 with 4 query heads: the heads of the
    target's layers of each type (their K/V head counts in the config, as the assistant's
    attention needs them), no K/V projections (every layer reads the target's). ``ordered``
    adds the centroid-masked head: 16 clusters of 17 tokens over a random ``token_ordering``, the
    top 4 scored. ``overrides`` replace top-level config entries (``backbone_hidden_size``...).
    """
    import mlx.core as mx

    target = json.loads((Path(target_dir) / "config.json").read_text())
    t = target.get("text_config", target)
    hidden, heads, inter, vocab = 32, 4, 64, t["vocab_size"]
    head_dims = {"sliding_attention": t["head_dim"], "full_attention": t.get("global_head_dim") or t["head_dim"]}
    layer_types = ["sliding_attention", "full_attention"]
    text = {
        "model_type": "gemma4_text", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 2,
        "num_attention_heads": heads, "num_key_value_heads": t["num_key_value_heads"], "head_dim": t["head_dim"],
        "global_head_dim": head_dims["full_attention"], "attention_k_eq_v": t.get("attention_k_eq_v", False),
        "num_global_key_value_heads": t.get("num_global_key_value_heads"), "layer_types": layer_types,
        "sliding_window": t["sliding_window"], "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0, "use_double_wide_mlp": False, "enable_moe_block": False,
        "final_logit_softcapping": None, "rms_norm_eps": 1e-6, "vocab_size": vocab, "tie_word_embeddings": True,
        "max_position_embeddings": t["max_position_embeddings"], "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    }
    config = {"model_type": "gemma4_assistant", "architectures": ["Gemma4AssistantForCausalLM"],
              "backbone_hidden_size": t["hidden_size"], "use_ordered_embeddings": ordered, "num_centroids": 16,
              "centroid_intermediate_top_k": 4, "tie_word_embeddings": True, "text_config": text, **overrides}
    rng = np.random.default_rng(seed)

    def linear(rows, cols):
        return rng.standard_normal((rows, cols)) / np.sqrt(cols)

    def norm(n):
        return 1.0 + 0.2 * rng.standard_normal(n)

    weights = {"model.embed_tokens.weight": 0.3 * rng.standard_normal((vocab, hidden)),
               "model.norm.weight": norm(hidden),
               "pre_projection.weight": linear(hidden, 2 * t["hidden_size"]),
               "post_projection.weight": linear(t["hidden_size"], hidden)}
    for i, kind in enumerate(layer_types):
        at, d = f"model.layers.{i}.", head_dims[kind]
        weights.update({
            at + "self_attn.q_proj.weight": linear(heads * d, hidden), at + "self_attn.q_norm.weight": norm(d),
            at + "self_attn.o_proj.weight": linear(hidden, heads * d), at + "mlp.gate_proj.weight": linear(inter, hidden),
            at + "mlp.up_proj.weight": linear(inter, hidden), at + "mlp.down_proj.weight": linear(hidden, inter),
            at + "layer_scalar": norm(1),
            **{at + f"{n}.weight": norm(hidden) for n in ("input_layernorm", "post_attention_layernorm",
                                                          "pre_feedforward_layernorm", "post_feedforward_layernorm")},
        })
    if ordered:
        weights["masked_embedding.centroids.weight"] = linear(16, hidden)
    arrays = {k: mx.array(v.astype(np.float32)) for k, v in weights.items()}
    if ordered:
        arrays["masked_embedding.token_ordering"] = mx.array(rng.permutation(vocab).astype(np.int64))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "pt"})
    return out


# ---- GGUF -------------------------------------------------------------------

_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}.{kind}"


def _permute_for_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qtype_of(name: str, array: np.ndarray, qtype: str, embedding_qtype: str | None) -> str:
    if array.ndim == 1:
        return "F32"  # llama.cpp keeps norms and biases in float32
    if name.startswith("model.embed_tokens") and embedding_qtype:
        return embedding_qtype
    return qtype


def load_tiny_weights(model_dir) -> tuple[dict, dict[str, np.ndarray]]:
    import mlx.core as mx

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(model_dir / "model.safetensors")).items()}
    return config, weights


def gguf_roundtrip_weights(model_dir, qtype: str, embedding_qtype: str | None = None) -> dict[str, np.ndarray]:
    """The directory's weights after quantizing to ``qtype`` and back (HF names, float32)."""
    from gguf import GGMLQuantizationType, quants

    _, weights = load_tiny_weights(model_dir)
    out = {}
    for name, w in weights.items():
        t = GGMLQuantizationType[_qtype_of(name, w, qtype, embedding_qtype)]
        out[name] = quants.dequantize(quants.quantize(w, t), t).astype(np.float32).reshape(w.shape)
    return out


def llama3_rope_factors(config: dict) -> np.ndarray:
    """Per-frequency factors llama.cpp stores as `rope_freqs.weight` for llama3 RoPE scaling.

    llama.cpp divides each rotation frequency by its factor; MLX's llama3 RoPE
    holds the stretched wavelengths, so the factor is their ratio to the
    unscaled ones.
    """
    from mlx_lm.models.rope_utils import Llama3RoPE

    dims, base = config["head_dim"], config["rope_theta"]
    scaled = np.array(Llama3RoPE(dims, base=base, scaling_config=config["rope_scaling"])._freqs)
    return (scaled / base ** (np.arange(0, dims, 2) / dims)).astype(np.float32)


def write_tiny_gguf(
    model_dir, path, qtype: str = "Q4_0", embedding_qtype: str | None = None, tokenizer: str = "gpt2"
) -> Path:
    """Write the tiny model in ``model_dir`` as a GGUF file like llama.cpp's converter would.

    ``qtype``: one of QTYPES, for every 2-D weight; ``embedding_qtype``
    overrides it for the token embedding (real files often keep it at Q8_0).
    ``tokenizer``: "gpt2" (the directory's byte-level BPE) or "llama" (the
    SentencePiece vocabulary of ``tiny_spm_vocab``). A llama3 ``rope_scaling``
    in config.json is written as a `rope_freqs` tensor, as llama.cpp does.
    """
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType, quants

    config, weights = load_tiny_weights(model_dir)
    arch = config["model_type"]
    path = Path(path)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_file_type(getattr(LlamaFileType, f"MOSTLY_{qtype}", LlamaFileType.ALL_F32))
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])

    if tokenizer == "gpt2":
        tokens, merges, special = tiny_vocab(config["vocab_size"])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_merges([f"{a} {b}" for a, b in merges])
        writer.add_token_types([TokenType.CONTROL if s else TokenType.NORMAL for s in special])
        writer.add_bos_token_id(config["bos_token_id"])
        writer.add_eos_token_id(config["eos_token_id"])
        writer.add_pad_token_id(config["bos_token_id"])
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    else:
        tokens, scores, types = tiny_spm_vocab(config["vocab_size"])
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(True)

    scaling = config.get("rope_scaling") or {}
    if (scaling.get("rope_type") or scaling.get("type")) == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))

    for name, w in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            w = _permute_for_llama_cpp(w, heads)
        t = GGMLQuantizationType[_qtype_of(name, w, qtype, embedding_qtype)]
        data = quants.quantize(w, t)
        writer.add_tensor(gguf_name(name), data, raw_dtype=t if t not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else None)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
