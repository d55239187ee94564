"""A decode step with and without the q/k/v kernel (``engined.kernels.qk_rope``), alternating in one process.

Two asynchronous engines over the same random weights of a real shape (bf16),
one with every layer's kernel turned off, each with c requests of 512-token
prompts decoding; then rounds of ``--steps`` timed steps on each in turn, the
order flipped every round. Per engine: ms per step, the part waiting on the
device, and the rest (host time), medians over the rounds; and the ratio.

    python -m bench.gpu_qk_rope_ab [--levels 1,16,64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main(argv=None) -> None:
    import mlx.core as mx

    from bench.gpu_serving import DEFAULT_CACHE_LIMIT, build_models, engine_for
    from engined.model_layers import transformer_layers
    from shared.protocol import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--out", help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    DEFAULT_CACHE_LIMIT.append(mx.set_cache_limit(0))
    mx.set_cache_limit(DEFAULT_CACHE_LIMIT[0])
    _, make_loaded, _ = build_models(args.model, "bf16", 0)
    rng = np.random.default_rng(0)
    steps_needed = args.rounds * args.steps + 16
    print("| c | kernel ms/step (wait) | MLX ops ms/step (wait) | kernel host | MLX ops host | host ratio |\n"
          "|---|---|---|---|---|---|", flush=True)
    for c in map(int, args.levels.split(",")):
        engines = {}
        for way in ("kernel", "mlx ops"):
            engine = engine_for(make_loaded, args, c, True)
            layers = [layer.self_attn for layer in transformer_layers(engine.loaded.model)]
            if way == "mlx ops":
                for attn in layers:
                    attn._qk_rope = None
            elif not all(attn._qk_rope is not None for attn in layers):
                raise SystemExit("the kernel is not on in every layer: not a CUDA machine?")
            params = SamplingParams(max_tokens=steps_needed + 16, temperature=0.0, ignore_eos=True)
            for i in range(c):
                engine.add_request(f"r{i}", rng.integers(0, 1 << 15, 512).tolist(), params)
            for _ in range(-(-c * 512 // args.max_num_batched_tokens) + 8):
                engine.step()
            engines[way] = engine
        got = {way: [] for way in engines}
        for r in range(args.rounds):
            for way in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                engine = engines[way]
                t0, w0 = time.perf_counter(), engine.sync_wait_s
                for _ in range(args.steps):
                    engine.step()
                dt, wait = time.perf_counter() - t0, engine.sync_wait_s - w0
                got[way].append((1e3 * dt / args.steps, 1e3 * wait / args.steps))
        med = {way: (statistics.median(s for s, _ in v), statistics.median(w for _, w in v)) for way, v in got.items()}
        (ks, kw), (ms, mw) = med["kernel"], med["mlx ops"]
        row = dict(model=args.model, c=c, kernel_ms=round(ks, 2), kernel_wait=round(kw, 2), ops_ms=round(ms, 2),
                   ops_wait=round(mw, 2), rounds={w: [[round(a, 2), round(b, 2)] for a, b in v] for w, v in got.items()})
        print(f"| {c} | {ks:.2f} ({kw:.2f}) | {ms:.2f} ({mw:.2f}) | {ks - kw:.2f} | {ms - mw:.2f} | "
              f"{(ms - mw) / (ks - kw):.2f}x |", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        for engine in engines.values():
            engine.abort(list(engine.requests))
            while engine.has_unfinished():
                engine.step()
        del engines
        mx.clear_cache()


if __name__ == "__main__":
    main()
