"""Offline throughput: mlxd's in-process Engine against mlx_lm's batch_generate.

Same model (the GGUF loaded by mlxd's loader, so the same weights and dtype),
same process (so the same BLAS), same greedy decoding, same prompts of mixed
lengths. Each concurrency level runs every system once as warm-up, then
``--repeats`` times, alternating; reports generated tokens/s (median) and
mlxd's ratio.

    python -m bench.offline_throughput [--model PATH] [--levels 1 8 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxd.engined.device import load_fast_blas

# A benchmark script, run as __main__: the fast BLAS before the imports below load mlx.core.
load_fast_blas()
import numpy as np
from mlx_lm.generate import batch_generate

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams


class _NoStop:
    """batch_generate stops on the tokenizer's eos ids; none here, so every request runs max_tokens."""

    eos_token_ids: list[int] = []

    def decode(self, ids):
        return ""


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 513, size=n)  # mixed lengths: what a packed step wins on
    return [rng.integers(100, vocab - 100, size=int(k)).tolist() for k in lengths]


def time_it(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_engine(loaded, max_seqs: int, max_tokens: int) -> Engine:
    """An engine whose pool holds ``max_seqs`` prompts of up to 512 tokens plus their outputs, no prefix caching."""
    return Engine(
        EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048,
                     num_kv_blocks=max_seqs * (600 + max_tokens) // 16 + 16, enable_prefix_caching=False),
        loaded=loaded,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    peer_model = load_model(args.model).model
    loaded = load_model(args.model)
    engine = make_engine(loaded, max(args.levels), args.max_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    rows = []
    for level in args.levels:
        prompts = make_prompts(level, loaded.vocab_size, seed=level)
        ours = lambda: engine.generate(prompts, params)  # noqa: E731
        peer = lambda: batch_generate(peer_model, _NoStop(), prompts, max_tokens=args.max_tokens,  # noqa: E731
                                      completion_batch_size=level, prefill_batch_size=min(level, 8))
        ours(), peer()  # warm-up
        # Alternate the two, so that background load falls on both alike.
        times = [(time_it(ours), time_it(peer)) for _ in range(args.repeats)]
        t_ours = statistics.median(a for a, _ in times)
        t_peer = statistics.median(b for _, b in times)
        tokens = level * args.max_tokens
        rows.append((level, tokens / t_ours, tokens / t_peer))
        print(f"concurrency {level:>2}: mlxd {tokens / t_ours:7.1f} tok/s   mlx_lm {tokens / t_peer:7.1f} tok/s"
              f"   ratio {t_peer / t_ours:.2f}x", flush=True)

    print("\n| concurrent requests | mlxd tok/s | mlx_lm batch_generate tok/s | ratio |")
    print("|---|---|---|---|")
    for level, a, b in rows:
        print(f"| {level} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
