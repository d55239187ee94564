"""How MLX's CUDA-graph settings change a decode step's host time, mlxd's and mlx_lm's, on a GPU.

MLX's CUDA backend records a step's kernels into CUDA graphs of at most
``MLX_MAX_OPS_PER_BUFFER`` operations and ``MLX_MAX_MB_PER_BUFFER`` of inputs
(100 and 1000 on an H100/H200), updates a cached executable graph when the
recorded one has the same topology, and launches it; a library call
(a cuBLASLt matmul) is captured from its stream into a sub-graph first. With
``MLX_USE_CUDA_GRAPHS=0`` every kernel is launched directly instead. The
settings are read once per process, so each one runs in a process of its own
(``--child``), one after another.

Each process builds a random-weight model of a real shape (bf16), then for
each concurrency: mlx_lm's time per decode step (the difference of two
``batch_generate`` runs, 88 and 24 tokens: 64 steps) where ``--mlx-lm-levels``
asks for it, and mlxd's asynchronous engine over ``--steps`` decode steps of
512-token prompts: ms per step and the part of it spent waiting on the
device. Host time is the rest: where the wait is near zero, the device
finishes before the host does.

    python -m bench.gpu_graphs [--settings default,direct,one-graph] [--levels 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SETTINGS = {
    "default": {},
    "direct": {"MLX_USE_CUDA_GRAPHS": "0"},
    "one-graph": {"MLX_MAX_OPS_PER_BUFFER": "4000", "MLX_MAX_MB_PER_BUFFER": "1000000"},
    "ops-400": {"MLX_MAX_OPS_PER_BUFFER": "400", "MLX_MAX_MB_PER_BUFFER": "1000000"},
}


def child(args) -> None:
    import mlx.core as mx

    from bench.gpu_serving import DEFAULT_CACHE_LIMIT, build_models, drain, engine_for, run_mlx_lm, start_decoding

    DEFAULT_CACHE_LIMIT.append(mx.set_cache_limit(0))
    mx.set_cache_limit(DEFAULT_CACHE_LIMIT[0])
    model, make_loaded, _ = build_models(args.model, "bf16", 0)
    rng = np.random.default_rng(0)
    mlx_lm_levels = {int(c) for c in args.mlx_lm_levels.split(",") if c}
    for c in map(int, args.levels.split(",")):
        row = dict(setting=args.setting, model=args.model, c=c)
        prompts = [rng.integers(0, model.args.vocab_size, 512).tolist() for _ in range(c)]
        if c in mlx_lm_levels:
            run_mlx_lm(model, prompts, 8)
            short, long = run_mlx_lm(model, prompts, 24), run_mlx_lm(model, prompts, 88)
            row["mlx_lm_ms_per_step"] = round(1e3 * (long - short) / 64, 2)
        engine = engine_for(make_loaded, args, c, True, encode_thread=False)
        start_decoding(engine, prompts, args.steps + 40)
        t0, w0 = time.perf_counter(), engine.sync_wait_s
        for _ in range(args.steps):
            engine.step()
        dt, wait = time.perf_counter() - t0, engine.sync_wait_s - w0
        row.update(mlxd_ms_per_step=round(1e3 * dt / args.steps, 2), wait_ms_per_step=round(1e3 * wait / args.steps, 2),
                   host_ms_per_step=round(1e3 * (dt - wait) / args.steps, 2))
        print("ROW " + json.dumps(row), flush=True)
        drain(engine)
        del engine
        mx.clear_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--settings", default="default,direct,one-graph")
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--mlx-lm-levels", default="1,16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--out", help="append the rows as JSON lines to this file")
    ap.add_argument("--child", metavar="SETTING", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.setting = args.child
        child(args)
        return
    rows = []
    for setting in args.settings.split(","):
        env = {**os.environ, **SETTINGS[setting]}
        cmd = [sys.executable, "-m", "bench.gpu_graphs", "--child", setting, "--model", args.model, "--levels",
               args.levels, "--mlx-lm-levels", args.mlx_lm_levels, "--steps", str(args.steps),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--num-kv-blocks", str(args.num_kv_blocks)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        print(f"== {setting} {SETTINGS[setting]}: rc={proc.returncode}, {time.perf_counter() - t0:.0f} s", flush=True)
        if proc.returncode:
            print(proc.stderr[-2000:], flush=True)
        for row in got:
            print("  " + json.dumps(row), flush=True)
        rows += got
        if args.out:
            with open(args.out, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in got)
    print("\n| setting | c | mlx_lm ms/step | mlxd ms/step | waiting | host |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['c']} | {r.get('mlx_lm_ms_per_step', '')} | {r['mlxd_ms_per_step']} | "
              f"{r['wait_ms_per_step']} | {r['host_ms_per_step']} |")


if __name__ == "__main__":
    main()
