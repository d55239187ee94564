"""Where a hybrid model's step goes on a GPU: each kind of layer timed apart, plain decoding and MTP.

    python -m bench.hybrid_step_probe --shape qwen3_5-8b --levels 1 4 16 --k 3 --p 0 1

For each concurrency ``c`` it runs ``c`` prompts through a plain engine and
through one speculating with MTP (``k`` drafts, forced to agree with the
target's greedy tokens with probability ``p``, as ``bench.speculative_mtp``
does), synchronously, and evaluates every layer's module where it returns:
the gated delta nets (with their state gathers and writes), full attention,
the MLPs, the MTP layer, and the rest of the step (embedding, head,
sampling, state restores, proposals' own work). The evaluations serialise
what the device would overlap, so the parts sum to more than a free-running
step; the split between them, and how each part grows with ``c`` and with
acceptance, is the measurement. Per-step medians over the steps after the
first (the prompts') are printed as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import mlx.core as mx
import mlx.nn as nn
import numpy as np

KINDS = ("linear_attn", "self_attn", "mlp", "mtp")


class Timed(nn.Module):
    """A module evaluated where it returns, its wall time added to ``spent[kind]``."""

    def __init__(self, inner: nn.Module, kind: str, spent: dict):
        super().__init__()
        self.inner, self.kind, self.spent = inner, kind, spent

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        mx.eval(out)
        self.spent[self.kind] += time.perf_counter() - t0
        return out


def instrument(engine, spent: dict) -> None:
    from engined.model_layers import transformer_layers

    for layer in transformer_layers(engine.runner.model):
        for kind in ("linear_attn", "self_attn", "mlp"):
            if kind in layer:
                setattr(layer, kind, Timed(getattr(layer, kind), kind, spent))
    if engine.mtp is not None:
        engine.mtp.layer = Timed(engine.mtp.layer, "mtp", spent)


def per_step(engine, prompts, params, spent: dict) -> list[dict]:
    """One generate, step by step: each step's wall time and its parts (ms)."""
    steps_of = engine.num_steps
    for i, p in enumerate(prompts):
        engine.add_request(f"probe-{steps_of}-{i}", p, params)
    steps = []
    while engine.has_unfinished():
        spent.clear()
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        parts = {k: 1e3 * spent.get(k, 0.0) for k in KINDS}
        steps.append(dict(wall=1e3 * wall, rest=1e3 * wall - sum(parts.values()), **parts))
    return steps


def median_row(steps: list[dict]) -> dict:
    later = steps[1:] or steps
    return {k: round(statistics.median(s[k] for s in later), 2) for k in later[0]}


def main() -> None:
    from bench import speculative_mtp as sm
    from engined.engine import Engine
    from shared.config import EngineConfig
    from shared.protocol import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3_5-8b", choices=sorted(sm.SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--p", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"mlx {mx.__version__} {mx.default_device()}; seed {args.seed}", flush=True)
    make_loaded, vocab = sm.build(args.shape, args.seed, args.dtype)
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for c in args.levels:
        base = dict(max_num_seqs=c, max_num_batched_tokens=4096, max_model_len=4096, async_scheduling=False,
                    num_kv_blocks=c * (args.prompt_tokens + args.max_tokens + 64) // 16 + 64)
        prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(c)]
        spent: dict = defaultdict(float)
        plain = Engine(EngineConfig(**base), loaded=make_loaded())
        truth = plain.generate(prompts, params)  # untimed: compiles, and the truth the drafts are forced to
        instrument(plain, spent)
        print(json.dumps(dict(c=c, engine="plain", **median_row(per_step(plain, prompts, params, spent)))),
              flush=True)
        del plain
        spec = Engine(EngineConfig(**base, speculative_config=json.dumps(
            {"method": "mtp", "num_speculative_tokens": args.k})), loaded=make_loaded())
        for p in args.p:
            spec.speculator.drafter = sm.ForcedDrafts(spec.mtp, {tuple(q): t for q, t in zip(prompts, truth)},
                                                      p, vocab, args.seed)
            spec.generate(prompts, params)  # untimed: compiles the windows' shapes
            if p == args.p[0]:
                instrument(spec, spent)
            steps = per_step(spec, prompts, params, spent)
            print(json.dumps(dict(c=c, engine=f"mtp k={args.k} p={p}", steps=len(steps),
                                  **median_row(steps))), flush=True)
        del spec
        mx.clear_cache()


if __name__ == "__main__":
    main()
