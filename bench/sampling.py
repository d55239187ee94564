"""What sampling costs over greedy decoding in the in-process Engine.

The same prompts and lengths run greedy and sampled (temperature 0.7,
top_p 0.95: what real clients send) at each concurrency level, alternating,
median of ``--repeats`` after a warm-up; reports generated tokens/s and the
sampled run's time over the greedy run's. Prompts are slices of this
project's README (``--prompts text``, the default: a real model's next-token
distribution is peaked) or random token ids (``--prompts random``: nearly flat
distributions, the sampler's worst case).

    python -m bench.sampling [--model PATH] [--levels 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from mlxd.bench.offline_throughput import make_engine, make_prompts, time_it
from mlxd.engined.loaders import load_model
from mlxd.shared.protocol import SamplingParams


def text_prompts(loaded, n: int) -> list[list[int]]:
    """``n`` slices of 64-512 tokens of the README, each from its own offset."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(loaded.tokenizer_dir).encode(
        (Path(__file__).resolve().parent.parent / "README.md").read_text())
    rng = np.random.default_rng(n)
    out = []
    for _ in range(n):
        length = int(rng.integers(64, 513))
        start = int(rng.integers(0, max(1, len(ids) - length)))
        out.append(ids[start : start + length])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--levels", type=int, nargs="+", default=[8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--prompts", choices=["text", "random"], default="text")
    args = ap.parse_args()

    loaded = load_model(args.model)
    engine = make_engine(loaded, max(args.levels), args.max_tokens)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                             ignore_eos=True, seed=0)
    rows = []
    for level in args.levels:
        prompts = (text_prompts(loaded, level) if args.prompts == "text"
                   else make_prompts(level, loaded.vocab_size, seed=level))
        runs = {name: (lambda p=p: engine.generate(prompts, p)) for name, p in (("greedy", greedy), ("sampled", sampled))}
        for run in runs.values():
            run()  # warm-up
        times = [(time_it(runs["greedy"]), time_it(runs["sampled"])) for _ in range(args.repeats)]
        t_greedy = statistics.median(g for g, _ in times)
        t_sampled = statistics.median(s for _, s in times)
        tokens = level * args.max_tokens
        rows.append((level, tokens / t_greedy, tokens / t_sampled, t_sampled / t_greedy))
        print(f"concurrency {level:>2}: greedy {tokens / t_greedy:7.1f} tok/s   sampled {tokens / t_sampled:7.1f} tok/s"
              f"   sampled/greedy time {t_sampled / t_greedy:.3f}", flush=True)

    print(f"\n| concurrent requests | greedy tok/s | sampled (T={args.temperature}, top_p={args.top_p}) tok/s "
          "| sampled time / greedy time |")
    print("|---|---|---|---|")
    for level, g, s, ratio in rows:
        print(f"| {level} | {g:.1f} | {s:.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
