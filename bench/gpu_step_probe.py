"""Where a decode step's time goes at c=1 and c=16 on a GPU: mlxd's Engine against mlx_lm's decode step.

Random weights of a real shape (``bench.gpu_serving.SHAPES``), 512-token
prompts, greedy. For each concurrency: mlx_lm's time per decode step (the
difference of two ``batch_generate`` runs, 88 and 24 tokens, over 64 steps);
then mlxd asynchronous and synchronous, 50 decode steps each, with MLX's
buffer cache unlimited and again capped where the memory guard caps it (its
warm-up's activations): a step that frees and allocates past the cap shows
as host time. The cap is timed first as the engine leaves it, then
unlimited, capped again, and capped with the cache cleared whenever it is
90 % full (MLX frees a released buffer at once, not into its cache, while the
cache is at its limit). The asynchronous engine's steps are then profiled
(cProfile, by own time and by cumulative time).

    python -m bench.gpu_step_probe [--model qwen3-8b]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np


def main() -> None:
    import mlx.core as mx

    from bench.gpu_serving import DEFAULT_CACHE_LIMIT, SHAPES, build_models, drain, engine_for, run_mlx_lm
    from shared.protocol import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--concurrency", default="1,16")
    args = ap.parse_args()
    DEFAULT_CACHE_LIMIT.append(mx.set_cache_limit(0))
    mx.set_cache_limit(DEFAULT_CACHE_LIMIT[0])

    class Budget:
        max_num_batched_tokens = 8192
        num_kv_blocks = 8192

    t0 = time.perf_counter()
    model, make_loaded, n = build_models(args.model, "bf16", 0)
    print(f"built {n / 1e9:.2f} G parameters in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    for c in map(int, args.concurrency.split(",")):
        prompts = [rng.integers(0, model.args.vocab_size, 512).tolist() for _ in range(c)]
        run_mlx_lm(model, prompts, 8)
        short, long = run_mlx_lm(model, prompts, 24), run_mlx_lm(model, prompts, 88)
        print(f"c={c} mlx_lm decode {1e3 * (long - short) / 64:.2f} ms/step", flush=True)
        for asynchronous in (True, False):
            engine = engine_for(make_loaded, Budget, c, asynchronous)
            params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, params)
            for _ in range(10):  # the prefill and the first decode steps
                engine.step()

            def timed(engine, label: str, steps: int = 50, clear_when_full: bool = False) -> None:
                cache0 = mx.get_cache_memory()
                t0, w0, clears = time.perf_counter(), engine.sync_wait_s, 0
                for _ in range(steps):
                    engine.step()
                    if clear_when_full and mx.get_cache_memory() >= 0.9 * limit:
                        mx.clear_cache()
                        clears += 1
                dt = time.perf_counter() - t0
                print(f"c={c} async={asynchronous} {label}: {1e3 * dt / steps:.2f} ms/step, waiting "
                      f"{1e3 * (engine.sync_wait_s - w0) / steps:.2f}; buffer cache {cache0 / 2**20:.0f} -> "
                      f"{mx.get_cache_memory() / 2**20:.0f} MiB" + (f", {clears} clears" if clear_when_full else ""),
                      flush=True)

            limit = int(engine.memory.activations)
            timed(engine, f"buffer cache capped at {limit / 2**20:.0f} MiB, as the engine runs")
            mx.set_cache_limit(1 << 40)
            timed(engine, "buffer cache unlimited")
            mx.set_cache_limit(limit)
            timed(engine, "capped again")
            timed(engine, "capped, cleared when 90 % full", clear_when_full=True)
            if asynchronous:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(30):
                    engine.step()
                prof.disable()
                stats = pstats.Stats(prof)
                stats.sort_stats("tottime").print_stats(28)
                stats.sort_stats("cumulative").print_stats(40)
            drain(engine)
            del engine
            mx.clear_cache()


if __name__ == "__main__":
    main()
