"""Pipeline and tensor parallelism against one process, same model, same requests, one run.

Each configuration (1 rank; pipelines of 2 and 3 ranks; tensor parallelism of 3)
runs as its own rank-0 process (``--run``) with its other ranks started by
``mlxd.ranks`` over loopback; the one-rank run is the reference its outputs are
checked against. Reports generated tokens/s, the ratio to one rank, and the
pipeline's idle fraction: with one batch in flight each of N ranks computes
its 1/N of the layers while a step takes the time T_N, so a rank is busy about
(T_1 / N) / T_N of it and idle the rest.

On a 2-core CPU the ranks share the cores, so this checks that work is spread
and outputs are kept, not speed; on a machine with one accelerator per rank
the same script measures the real thing.

    python -m bench.pipeline [--model PATH] [--requests 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import msgspec
import numpy as np

from shared.config import EngineConfig

CONFIGS = {
    "1 rank": {},
    "pipeline x2": {"pipeline_parallel_size": 2},
    "pipeline x3": {"pipeline_parallel_size": 3},
    "tensor x3": {"tensor_parallel_size": 3},  # SmolLM2 has 3 KV heads
}


def _rank0(config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> dict:
    """Rank 0 in this process: warm up, then time the batch."""
    from mlxd import ranks

    children = ranks.start_local(config) if config.num_ranks > 1 else []
    try:
        from engined.device import load_fast_blas

        load_fast_blas()
        from engined.engine import Engine
        from shared.sampling import SamplingParams

        engine = Engine(config)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        start = time.perf_counter()
        tokens = engine.generate(prompts, params)
        return {"seconds": time.perf_counter() - start, "tokens": tokens}
    finally:
        for child in children:
            child.terminate()
            child.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="model (default: the embedded SmolLM2, 30 layers)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--run", help=argparse.SUPPRESS)  # internal: CONFIG_JSON PROMPTS_JSON MAX_TOKENS
    args, rest = ap.parse_known_args()
    if args.run:
        config = msgspec.json.decode(args.run, type=EngineConfig)
        print(json.dumps(_rank0(config, json.loads(rest[0]), int(rest[1]))), flush=True)
        return 0
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, args.prompt_len).tolist() for _ in range(args.requests)]
    base = dict(model=args.model, max_model_len=1024, num_kv_blocks=256, max_num_seqs=args.requests,
                max_num_batched_tokens=1024, enable_prefix_caching=False)
    results = {}
    for name, parallel in CONFIGS.items():
        config = EngineConfig(**base, **parallel)
        out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--run", msgspec.json.encode(config).decode(),
                              json.dumps(prompts), str(args.max_tokens)], capture_output=True, text=True)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    one = results["1 rank"]
    generated = args.requests * args.max_tokens
    print(f"{args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} generated tokens, greedy\n")
    print("| configuration | seconds | generated tok/s | vs 1 rank | outputs equal | idle fraction per rank |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        n = CONFIGS[name].get("pipeline_parallel_size", 1)
        idle = f"{1 - (one['seconds'] / n) / r['seconds']:.2f}" if n > 1 else "-"
        print(f"| {name} | {r['seconds']:.2f} | {generated / r['seconds']:.1f} | {one['seconds'] / r['seconds']:.2f}x "
              f"| {r['tokens'] == one['tokens']} | {idle} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
