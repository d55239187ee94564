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
    arch: str  # mlx_lm model_type; tests build a tiny random-weight model of it
    examples: str  # real checkpoints of this architecture, for readers
    attention: str  # what its attention needs from the paged step
    mlp: str
    weights: tuple[str, ...] = WEIGHTS  # parity tests run with each
    prefix_caching: bool = True  # a test compares outputs with prefix caching on and off
    speculative: bool = True  # a test compares greedy outputs with n-gram speculation on and off


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama 3.x, SmolLM2", "full, GQA", "dense"),
    Family("qwen2", "Qwen2.5", "full, GQA, q/k/v bias", "dense"),
    Family("qwen3", "Qwen3 dense", "full, GQA, q/k norms", "dense"),
    Family("qwen3_moe", "Qwen3-30B-A3B, Qwen3-235B-A22B", "full, GQA, q/k norms", "MoE (top-k of N experts)"),
    Family("gpt_oss", "gpt-oss-20b, gpt-oss-120b", "sliding window + global layers, attention sinks", "MoE"),
    Family("gemma3_text", "Gemma 3 (text)", "sliding window + global layers, per-layer RoPE, q/k norms", "dense"),
    # Recurrent state cannot take rejected drafts back: speculation is refused for hybrids.
    Family("qwen3_next", "Qwen3-Next-80B-A3B", "gated delta net + gated full attention (hybrid)", "MoE + shared expert",
           speculative=False),
    Family("qwen3_5", "Qwen3.5 (text)", "gated delta net + gated full attention (hybrid)", "dense",
           speculative=False),
    Family("qwen3_5_moe", "Qwen3.5 MoE (text)", "gated delta net + gated full attention (hybrid)",
           "MoE + shared expert", speculative=False),
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
        lines.append(
            f"| `{f.arch}` | {f.examples} | {f.attention} | {f.mlp} | {', '.join(f.weights)} "
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
