"""TTFT over HTTP under Poisson arrivals: `mlxd serve` against `mlx_lm.server` on one random checkpoint.

``bench.gpu_serving`` drives both sides in its own process; this one serves
them as users meet them, each a real server on loopback, each sent the same
chat requests (streamed, greedy) as sessions arriving at Poisson times
(``mlxd bench --rate``, the agent harness's open loop). The checkpoint is a
random-weight model of a real shape (``bench.gpu_serving.SHAPES``) written
to ``--dir`` once, with a byte-level tokenizer whose every id past the bytes
decodes to a visible word, so random weights stream text and every chunk
counts for TTFT and inter-token latency.

    python -m bench.gpu_ttft --model qwen3-8b --dtype bf16 --rate 2 --num-prompts 64 --dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

def write_tokenizer(out: Path, vocab_size: int, context: int) -> None:
    """Bytes, the ChatML specials, then ordinary words (" w<i>") up to ``vocab_size``: prompts encode
    to bytes, and any id a random model samples decodes to text."""
    from tests import tiny_models

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = tiny_models.byte_chars() + specials
    special = [False] * 256 + [True] * len(specials)
    words = vocab_size - len(tokens)
    tiny_models.write_tokenizer(out, tokens + [f"Ġw{i}" for i in range(words)], [], special + [False] * words,
                                "<|endoftext|>", "<|im_end|>", context)


def write_checkpoint(shape: str, dtype: str, seed: int, out: Path) -> Path:
    """A random-weight checkpoint of ``shape`` that mlx_lm and mlxd both load (MLX layout)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from bench.gpu_serving import SHAPES, build_models

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    model, _, _ = build_models(shape, dtype, seed)
    config = dict(SHAPES[shape], bos_token_id=256, eos_token_id=258)
    if dtype == "q4":
        config["quantization"] = {"group_size": 64, "bits": 4}
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    write_tokenizer(out, config["vocab_size"], config["max_position_embeddings"])
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: its presence marks a whole checkpoint
    return out


def main(argv=None) -> int:
    from bench.agent import harness
    from bench.gpu_serving import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "q4"))
    ap.add_argument("--dir", required=True, help="where the checkpoint is written (kept for the next run)")
    ap.add_argument("--rate", type=float, default=2.0, help="sessions (chat requests) arriving a second")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--token-scale", type=float, default=0.5, help="chat prompt sizes (bytes are tokens here)")
    ap.add_argument("--slots", type=int, default=64, help="requests each server is sized for at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results", help="where the harness writes its JSON and Markdown")
    args = ap.parse_args(argv)
    ckpt = write_checkpoint(args.model, args.dtype, args.seed, Path(args.dir))
    return harness.run(["--servers", "mlxd,mlx_lm", "--model", str(ckpt), "--split", "chat",
                        "--concurrency", str(args.slots), "--rate", str(args.rate),
                        "--num-prompts", str(args.num_prompts), "--token-scale", str(args.token_scale),
                        "--seed", str(args.seed), "--out", args.out])


if __name__ == "__main__":
    raise SystemExit(main())
