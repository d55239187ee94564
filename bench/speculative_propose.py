"""What one MTP proposal costs against one plain target step, for k = 1..4 drafts and a few concurrencies.

A random-weight hybrid model (``bench.speculative_mtp``'s shapes; the default,
``qwen3_5-deep``, is narrow and 32 layers deep, so that, as on a GPU, the
cost of a forward is its dispatch and synchronisation rather than its
arithmetic) decodes (greedily, or sampled with ``--temperature``) without
speculation and with MTP at each ``k``. Reported per (c, k): the plain engine's time per step, the MTP
proposal's time per step (``ForcedDrafts`` times the whole ``propose``: the
catch-up forward, the ``k - 1`` draft forwards, the sampling and the host's
read of the drafts), their ratio, and how many times a proposal waited for
the device (``mx.eval`` and array reads to the host, counted by wrapping them).

    python -m bench.speculative_propose --shape qwen3_5-deep --levels 1 16 --ks 1 2 3 4 [--temperature 0.8]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from engined.device import load_fast_blas

# A benchmark script, run as __main__: the fast BLAS before the imports below load mlx.core.
load_fast_blas()
from bench.device_waits import DeviceWaits  # noqa: E402
from bench.speculative_mtp import SHAPES, ForcedDrafts, build, timed  # noqa: E402
from engined.engine import Engine  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402


class CountedDrafts(ForcedDrafts):
    """``ForcedDrafts`` that also counts the inner proposal's waits for the device."""

    syncs = 0

    def propose(self, batch, drafting, drafts):
        with DeviceWaits() as count:
            out = super().propose(batch, drafting, drafts)
        self.syncs += count.count
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3_5-deep", choices=sorted(SHAPES))
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--p", type=float, default=0.7, help="the rate drafts are made to agree with the target")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row; the fastest is reported")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="above 0: sampled decoding, whose drafts carry their distribution for rejection sampling")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    make_loaded, vocab = build(args.shape, args.seed)
    rng = np.random.default_rng(args.seed)
    base = dict(max_num_seqs=max(args.levels), max_num_batched_tokens=4096, max_model_len=2048,
                num_kv_blocks=max(args.levels) * (args.prompt_tokens + args.max_tokens + 64) // 16 + 64)
    plain = Engine(EngineConfig(**base), loaded=make_loaded())
    specs = {k: Engine(EngineConfig(**base, speculative_config=json.dumps(
        {"method": "mtp", "num_speculative_tokens": k})), loaded=make_loaded()) for k in args.ks}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            ignore_eos=True)
    rows = []
    for c in args.levels:
        prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(c)]
        timed(plain, prompts, params)  # untimed: first shapes
        runs = [timed(plain, prompts, params) for _ in range(args.repeats)]
        plain_step = min(wall / steps for wall, _, steps in runs)
        truths = {tuple(p): t for p, t in zip(prompts, runs[0][1])}
        for k, spec in specs.items():
            best = None
            for rep in range(args.repeats + 1):  # the first untimed, as above
                forced = CountedDrafts(spec.mtp, truths, args.p, vocab, args.seed)
                spec.speculator.drafter = forced
                _, out, _ = timed(spec, prompts, params)
                # Greedy outputs match exactly in float32 (the tests hold that); in bf16 a k+1-token verify
                # rounds differently from a 1-token step, and random weights leave near-ties that flip.
                same = np.mean([a == b for o, r in zip(out, runs[0][1]) for a, b in zip(o, r)])
                per_call = (forced.seconds / forced.calls, forced.syncs / forced.calls)
                if rep and (best is None or per_call < best):
                    best = per_call
            row = dict(c=c, k=k, plain_step_ms=round(1e3 * plain_step, 2), propose_ms=round(1e3 * best[0], 2),
                       ratio=round(best[0] / plain_step, 3), syncs_per_proposal=round(best[1], 2),
                       same_greedy_tokens=round(float(same), 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| c | k | plain step ms | MTP proposal ms | proposal / plain step | device waits per proposal "
          "| greedy tokens as plain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['c']} | {r['k']} | {r['plain_step_ms']:.2f} | {r['propose_ms']:.2f} | {r['ratio']:.2f} | "
              f"{r['syncs_per_proposal']:.1f} | {r['same_greedy_tokens']:.3f} |")


if __name__ == "__main__":
    main()
