"""The model-support matrix: which architectures the tests run, with which weights and features.

``tests/engined/test_families.py`` is parametrized from ``FAMILIES``, and the
README's model-support table is rendered from the same rows, so the table
says exactly what the tests prove. ``python -m tests.model_support`` rewrites
the README section between the markers; a test fails when it is stale.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- model-support:begin: written by `python -m tests.model_support`, do not edit -->"
END = "<!-- model-support:end -->"

# Weight formats a family's parity test runs: float32, and MLX affine 4-bit (group 32) of every
# linear layer, expert and embedding.
WEIGHTS = ("float32", "4-bit")


@dataclass(frozen=True)
class Family:
    arch: str  # tests build a tiny random-weight model of this tests/tiny_models.py entry
    examples: str  # real checkpoints of this architecture, for readers
    attention: str  # what its attention needs from the paged step
    mlp: str
    weights: tuple[str, ...] = WEIGHTS  # parity tests run with each
    prefix_caching: bool = True  # a test compares outputs with prefix caching on and off
    speculative: bool = True  # a test compares greedy outputs with n-gram speculation on and off
    # config.json's model_type, and the text model_type a wrapper holds in text_config (when the
    # tiny model's entry name is not the model_type itself).
    model_type: str = ""
    text_model_type: str = ""

    @property
    def config_type(self) -> str:
        return self.model_type or self.arch


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama 3.x, SmolLM2", "full, GQA", "dense"),
    Family("mistral", "Mistral 7B, Mistral Nemo", "full, GQA (mlx_lm runs it as Llama)", "dense"),
    Family("smollm3", "SmolLM3-3B", "full, GQA, no RoPE in every fourth layer", "dense"),
    Family("qwen2", "Qwen2.5", "full, GQA, q/k/v bias", "dense"),
    Family("qwen3", "Qwen3 dense", "full, GQA, q/k norms", "dense"),
    Family("qwen3_moe", "Qwen3-30B-A3B, Qwen3-235B-A22B", "full, GQA, q/k norms", "MoE (top-k of N experts)"),
    Family("mixtral", "Mixtral 8x7B, 8x22B", "full, GQA", "MoE (top-2 of 8)"),
    Family("phi3", "Phi-3, Phi-3.5, Phi-4, Phi-4-mini", "full, fused qkv, partial LongRoPE", "dense, fused gate/up"),
    Family("olmo2", "OLMo 2", "full, q/k norms over all heads", "dense"),
    Family("glm4", "GLM-4-0414", "full, q/k/v bias, partial interleaved RoPE", "dense, fused gate/up"),
    Family("glm4_moe", "GLM-4.5, GLM-4.5-Air, GLM-4.6", "full, q/k norms, partial RoPE",
           "dense first layers, then sigmoid-routed MoE + shared expert"),
    Family("ministral3", "Ministral 3 (text)", "sliding window + global layers, YaRN, position-scaled queries",
           "dense"),
    Family("mistral3", "Mistral Small 3.1 / 3.2 (vision checkpoint: images in, tests/engined/test_vision.py)",
           "full, GQA (Mistral inside)", "dense", text_model_type="mistral"),
    Family("mistral3_ministral3", "Ministral 3 3B/8B/14B (vision checkpoint)",
           "sliding window + global layers, YaRN, position-scaled queries", "dense",
           model_type="mistral3", text_model_type="ministral3"),
    Family("idefics3", "SmolVLM 256M / 500M / 2.2B, Idefics3 (vision checkpoint: images in, "
           "tests/engined/test_vision.py)", "full, GQA (Llama inside)", "dense", text_model_type="llama"),
    Family("qwen2_5_vl", "Qwen2.5-VL 3B / 7B / 32B / 72B (vision checkpoint: images in, M-RoPE, "
           "tests/engined/test_vision.py)", "full, GQA (Qwen2 inside), multi-axis RoPE for image tokens", "dense"),
    Family("gpt_oss", "gpt-oss-20b, gpt-oss-120b", "sliding window + global layers, attention sinks", "MoE"),
    Family("gemma2", "Gemma 2", "full (as mlx_lm runs it), attention logit soft cap, final soft cap", "dense"),
    Family("gemma3_text", "Gemma 3 (text)", "sliding window + global layers, per-layer RoPE, q/k norms", "dense"),
    Family("gemma3", "Gemma 3 4B-27B (vision checkpoint: images in, tests/engined/test_vision.py)", "as gemma3_text",
           "dense", text_model_type="gemma3_text"),
    Family("gemma4_text", "Gemma 4 26B-A4B, 31B (text)",
           "sliding + global layers, later layers read earlier layers' K/V, K = V on global layers, "
           "final soft cap", "dense + MoE beside it"),
    Family("gemma4", "Gemma 4 E2B, E4B (vision checkpoint: images in, tests/engined/test_vision.py)",
           "sliding + global layers, shared K/V, per-layer inputs, "
           "proportional partial RoPE, final soft cap", "dense (double-wide in shared layers)",
           text_model_type="gemma4_text"),
    # Hybrids speculate with a verification window run position by position through the delta nets
    # (the state after each kept, the accepted one restored); n-gram, draft model and their MTP layer.
    Family("qwen3_next", "Qwen3-Next-80B-A3B", "gated delta net + gated full attention (hybrid)", "MoE + shared expert"),
    Family("qwen3_5", "Qwen3.5 (text)", "gated delta net + gated full attention (hybrid)", "dense"),
    Family("qwen3_5_moe", "Qwen3.5 MoE (text)", "gated delta net + gated full attention (hybrid)",
           "MoE + shared expert"),
    # The same text models as their vision-language checkpoints hold them: the layout is what is tested.
    Family("qwen3_5_vl", "Qwen3.5 (vision checkpoint: images in, interleaved M-RoPE, tests/engined/test_vision.py)",
           "as qwen3_5, multi-axis RoPE for image tokens", "dense", weights=("float32",),
           prefix_caching=False, speculative=False, model_type="qwen3_5", text_model_type="qwen3_5_text"),
    Family("qwen3_5_moe_vl", "Qwen3.5 MoE (vision checkpoint: images in, interleaved M-RoPE, "
           "tests/engined/test_vision.py)", "as qwen3_5_moe, multi-axis RoPE for image tokens", "MoE + shared expert",
           weights=("float32",), prefix_caching=False, speculative=False, model_type="qwen3_5_moe",
           text_model_type="qwen3_5_moe_text"),
)


def _mark(ok: bool) -> str:
    return "yes" if ok else "no"


def render() -> str:
    """The markdown table, one row per family."""
    lines = [
        "| architecture (`model_type`) | e.g. | attention | MLP | weights tested | prefix caching "
        "| speculative decoding |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        arch = f"`{f.config_type}`" + (f" (text: `{f.text_model_type}`)" if f.text_model_type else "")
        lines.append(
            f"| {arch} | {f.examples} | {f.attention} | {f.mlp} | {', '.join(f.weights)} "
            f"| {_mark(f.prefix_caching)} | {_mark(f.speculative)} |"
        )
    return "\n".join(lines)


def section() -> str:
    return f"{BEGIN}\n{render()}\n{END}"


def readme_with_table(text: str) -> str:
    """``text`` with the section between the markers replaced by the current table."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{README.name} has no model-support markers")
    return text[:start] + section() + text[end + len(END):]


def main() -> int:
    text = README.read_text()
    new = readme_with_table(text)
    if new != text:
        README.write_text(new)
        print(f"{README} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
