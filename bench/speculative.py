"""Speculative decoding against no speculation, in one run.

``--method ngram`` (the default): a code-editing workload on the embedded
model. The prompt holds the code to be rewritten, so the answer largely
copies it: the case prompt lookup exists for. Reports end-to-end latency
(median over requests) at each concurrency with and without speculation,
their ratio, and the acceptance rate (accepted / drafted tokens).

``--method mtp``: a random-weight hybrid model with its MTP layer, drafts
forced to agree with the target at the rates ``--p`` (``bench.speculative_mtp``).

    python -m bench.speculative [--levels 1 8] [--max-tokens 128] [--k 4]
    python -m bench.speculative --method mtp --shape qwen3_5-8b --levels 1 4 16 --k 3 --p 0 0.5 0.7 0.9 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mlxd.engined.device import load_fast_blas

# A benchmark script, run as __main__: the fast BLAS before the imports below load mlx.core.
load_fast_blas()
from mlxd.engined.engine import Engine  # noqa: E402
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams

SNIPPETS = [
    "def area(width, height):\n    result = width * height\n    return result\n\n"
    "def perimeter(width, height):\n    result = 2 * (width + height)\n    return result\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count = self.count + 1\n        return self.count\n",
    "for index in range(10):\n    if index % 2 == 0:\n        print('even', index)\n    else:\n"
    "        print('odd', index)\n",
    "def greet(name):\n    message = 'Hello, ' + name\n    print(message)\n    return message\n",
]


def workload(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        code = SNIPPETS[i % len(SNIPPETS)]
        text = f"Rewrite this code, renaming nothing and keeping it exactly as it is:\n\n{code}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


def run(engine: Engine, prompts, params) -> list[float]:
    """Submit all at once; returns each request's end-to-end latency."""
    start = time.perf_counter()
    ids = [f"b{run.n + i}" for i in range(len(prompts))]
    run.n += len(prompts)
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finish_reason:
                done[out.request_id] = time.perf_counter() - start
    return [done[r] for r in ids]


run.n = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--method", choices=("ngram", "mtp"), default="ngram")
    ap.add_argument("--shape", default="qwen3_5-8b", help="mtp: the random model's shape (bench.speculative_mtp)")
    ap.add_argument("--p", type=float, nargs="+", default=[0.0, 0.5, 0.7, 0.9, 1.0],
                    help="mtp: the rates at which draft tokens are made to agree with the target")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="mtp: random prompt length")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="mtp: the dtype of the random weights")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.method == "mtp":
        from mlxd.bench import speculative_mtp

        speculative_mtp.main(args)
        return
    from transformers import AutoTokenizer

    spec_cfg = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    base = dict(model=args.model, max_num_seqs=max(args.levels), max_num_batched_tokens=1024,
                num_kv_blocks=max(args.levels) * 40 + 64, enable_prefix_caching=False)
    plain = Engine(EngineConfig(**base), loaded=load_model(args.model))
    spec = Engine(EngineConfig(**base, speculative_config=spec_cfg), loaded=load_model(args.model))
    tok = AutoTokenizer.from_pretrained(plain.info.tokenizer_dir)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    rows = []
    for level in args.levels:
        prompts = workload(tok, level)
        run(plain, prompts, params), run(spec, prompts, params)  # warm-up
        m = spec.metrics
        drafted0, accepted0 = m.spec_draft_tokens._value.get(), m.spec_accepted._value.get()
        t_plain, t_spec = [], []
        for _ in range(args.repeats):  # alternate, so background load hits both alike
            t_plain += run(plain, prompts, params)
            t_spec += run(spec, prompts, params)
        drafted = m.spec_draft_tokens._value.get() - drafted0
        accepted = m.spec_accepted._value.get() - accepted0
        a, b = statistics.median(t_plain), statistics.median(t_spec)
        rows.append((level, a, b, accepted / max(drafted, 1)))
        print(f"concurrency {level}: e2e plain {a:.2f}s  ngram {b:.2f}s  speed-up {a / b:.2f}x  "
              f"acceptance {accepted / max(drafted, 1):.0%}", flush=True)

    print("\n| concurrency | e2e latency, no speculation | e2e latency, n-gram k=%d | speed-up | acceptance |" % args.k)
    print("|---|---|---|---|---|")
    for level, a, b, acc in rows:
        print(f"| {level} | {a:.2f} s | {b:.2f} s | {a / b:.2f}x | {acc:.0%} |")


if __name__ == "__main__":
    main()
