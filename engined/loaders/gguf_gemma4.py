"""Gemma 4 (dense) GGUF configuration: llama.cpp spreads it over per-layer arrays and a tensor.

The converter writes the global layers' head size as ``key_length`` and the
sliding layers' as ``key_length_swa``; which layers slide as a boolean array
``attention.sliding_window_pattern``; FFN sizes and KV head counts per layer
when they differ (double-wide MLPs of the KV-shared layers, global KV heads);
and the global layers' partial ("proportional") RoPE as a ``rope_freqs``
tensor whose unrotated pairs carry a factor of 1e30. The MoE variant's
router scale and per-expert scale are ``.scale`` tensors of ffn_gate_inp and
ffn_down_exps.
"""

from __future__ import annotations

from typing import Callable


GEMMA4_LAYERS = {
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale": "layer_scalar",
    # the MoE variant: experts beside the dense MLP, with their own norms
    "ffn_gate_inp": "router.proj",
    "ffn_gate_exps": "experts.switch_glu.gate_proj",
    "ffn_up_exps": "experts.switch_glu.up_proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
# ".scale" tensors of the MoE variant: the router's input scale and the per-expert output scale
GEMMA4_SCALES = {"ffn_gate_inp": "router.scale", "ffn_down_exps": "router.per_expert_scale"}
GEMMA4_GLOBALS = {
    "per_layer_token_embd": "embed_tokens_per_layer",
    "per_layer_model_proj": "per_layer_model_projection",
    "per_layer_proj_norm": "per_layer_projection_norm",
}


def _per_layer(value, n: int) -> list:
    return list(value) if hasattr(value, "__len__") else [value] * n


def gemma4_config(get: Callable, shapes: dict, read: Callable) -> dict:
    n = int(get("block_count"))
    sliding = [bool(s) for s in _per_layer(get("attention.sliding_window_pattern"), n)]
    kinds = ["sliding_attention" if s else "full_attention" for s in sliding]
    kv = [int(k) for k in _per_layer(get("attention.head_count_kv"), n)]
    ffn = [int(f) for f in _per_layer(get("feed_forward_length"), n)]
    shared = int(get("attention.shared_kv_layers", 0))
    head_dim, global_head_dim = int(get("attention.key_length_swa")), int(get("attention.key_length"))
    full = next((i for i, s in enumerate(sliding) if not s), 0)
    swa = next((i for i, s in enumerate(sliding) if s), 0)
    global_partial = 1.0
    if "rope_freqs.weight" in shapes:
        factors = read("rope_freqs.weight")
        global_partial = 2 * int((factors < 1e29).sum()) / global_head_dim
    config = {
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_key_value_heads": kv[swa],
        "num_global_key_value_heads": kv[full],
        # K = V on the global layers: llama.cpp stores no attn_v for them
        "attention_k_eq_v": f"blk.{full}.attn_k.weight" in shapes and f"blk.{full}.attn_v.weight" not in shapes,
        "intermediate_size": ffn[0],
        "use_double_wide_mlp": shared > 0 and ffn[-1] == 2 * ffn[0],
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(get("embedding_length_per_layer_input", 0)),
        "layer_types": kinds,
        "sliding_window": int(get("attention.sliding_window", 512)),
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": global_partial,
                "rope_theta": float(get("rope.freq_base", 1000000.0)),
                "rope_type": "proportional",
            },
            "sliding_attention": {
                "partial_rotary_factor": int(get("rope.dimension_count_swa", head_dim)) / head_dim,
                "rope_theta": float(get("rope.freq_base_swa", 10000.0)),
                "rope_type": "default",
            },
        },
    }
    if "blk.0.ffn_gate_inp.weight" in shapes:
        config.update(
            enable_moe_block=True,
            num_experts=int(get("expert_count")),
            top_k_experts=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
        )
    if (softcap := get("final_logit_softcapping")) is not None:
        config["final_logit_softcapping"] = float(softcap)
    if "per_layer_token_embd.weight" in shapes:
        config["vocab_size_per_layer_input"] = shapes["per_layer_token_embd.weight"][0]
    return config
