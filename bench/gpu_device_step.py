"""The device's own time for one decode step on a GPU, with the host taken off the critical path.

A step's wall time is the host's (building and encoding its graph) or the
device's, whichever is longer. This probe measures the device's: before each
step's launch it queues a kernel that spins on the GPU's clock
(``%globaltimer``) for ``--spin-ms`` and records when it let go; the step is
built and encoded while the device spins, so its kernels wait queued behind
it; a second kernel after the step records the clock again. The difference is
the time the device took for the step from a full queue: kernels, their gaps
and the graph launch, no host in it.

For the whole step to be queued behind the spin, MLX must not wait on the
device while encoding it (it does after ten committed graphs in flight), so
this process records each step into one CUDA graph (``MLX_MAX_OPS_PER_BUFFER``
and ``MLX_MAX_MB_PER_BUFFER`` set before MLX loads, unless the environment sets
them: a step of up to ten graphs still queues whole); the probe checks that the
host finished queuing the step before the spin ended and fails otherwise.

    python -m bench.gpu_device_step [--levels 1,16,64] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

GRAPH_SETTINGS = {"MLX_MAX_OPS_PER_BUFFER": "100000", "MLX_MAX_MB_PER_BUFFER": "10000000"}

_CLOCK = 'unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));\n'
_SPIN_SOURCE = _CLOCK + """
unsigned long long t0 = t;
while (t - t0 < (unsigned long long)ns[0]) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
stamp[0] = t;
"""
STAMP_SOURCE = _CLOCK + "stamp[0] = t;\n"


def clock_kernels():
    """(spin, stamp): ``spin(ms)`` holds the device for ``ms`` and gives the GPU clock (ns) at its end; ``stamp()``
    the clock when it runs. Both compiled here, before anything is timed."""
    import mlx.core as mx

    spin_kernel = mx.fast.cuda_kernel(name="mlxd_probe_spin", input_names=["ns"], output_names=["stamp"],
                                      source=_SPIN_SOURCE)
    stamp_kernel = mx.fast.cuda_kernel(name="mlxd_probe_stamp", input_names=["after"], output_names=["stamp"],
                                       source=STAMP_SOURCE)

    def clock(kernel, arg):
        return kernel(inputs=[mx.array([arg], dtype=mx.uint64)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                      output_shapes=[(1,)], output_dtypes=[mx.uint64])[0]

    def spin(ms):
        return clock(spin_kernel, int(ms * 1e6))

    def stamp():
        return clock(stamp_kernel, 0)

    mx.eval(spin(0), stamp())
    return spin, stamp


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--spin-ms", type=float, default=1000.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--out", help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    # Read once, when MLX's CUDA back-end starts: before the import below. A setting given in the
    # environment wins (up to ten graphs a step still queue behind the spin).
    os.environ.update({k: v for k, v in GRAPH_SETTINGS.items() if k not in os.environ})

    import mlx.core as mx

    from mlxd.bench.gpu_serving import DEFAULT_CACHE_LIMIT, build_models, drain, engine_for, start_decoding
    from mlxd.engined.sampler import LaunchedStep

    spin, stamp = clock_kernels()
    DEFAULT_CACHE_LIMIT.append(mx.set_cache_limit(0))
    mx.set_cache_limit(DEFAULT_CACHE_LIMIT[0])
    model, make_loaded, _ = build_models(args.model, "bf16", 0)
    rng = np.random.default_rng(0)
    real_start, measured, queued, timing, inside = LaunchedStep.start, [], [], [False], [0.0]

    def timed_start(self, encoder=None):
        """The step's launch between the two clock kernels; waits for both, then keeps the device's time."""
        entered = time.perf_counter()
        held = spin(args.spin_ms)
        mx.async_eval(held)  # launched: the device spins while the step below is built and queued
        t0 = time.perf_counter()
        real_start(self, encoder)
        after = stamp()
        mx.async_eval(after)
        queued_ms = 1e3 * (time.perf_counter() - t0)
        mx.eval(after)
        measured.append((int(after.item()) - int(held.item())) / 1e6)
        queued.append(queued_ms)
        inside[0] += time.perf_counter() - entered
        if timing[0] and queued_ms > 0.8 * args.spin_ms:
            raise SystemExit(f"queuing the step took {queued_ms:.1f} ms of a {args.spin_ms} ms spin: raise --spin-ms")

    limits = os.environ["MLX_MAX_OPS_PER_BUFFER"], os.environ["MLX_MAX_MB_PER_BUFFER"]
    print(f"device ms a decode step ({args.model}, bf16, CUDA graphs of at most {limits[0]} kernels and "
          f"{limits[1]} MB of inputs); queued: the host's "
          "ms in mx.async_eval for it, MLX's encoding with the device held; host: the engine's whole step on the "
          "host, the queuing included\n"
          "| c | device ms/step (median) | min | max | queued ms | host ms |\n|---|---|---|---|---|---|", flush=True)
    for c in map(int, args.levels.split(",")):
        engine = engine_for(make_loaded, args, c, True, encode_thread=False)
        start_decoding(engine, [rng.integers(0, model.args.vocab_size, 512).tolist() for _ in range(c)],
                       args.steps + 40)
        LaunchedStep.start = timed_start
        try:
            # A step's CUDA graphs are instantiated the first time its shape is met;
            # with compiled decode the second step of a shape is traced and the third JIT-compiles its fused
            # kernels: none of these is timed.
            for _ in range(4):
                engine.step()
            measured.clear()
            queued.clear()
            timing[0] = True
            host = []  # the step's host time: its wall time less the wait in timed_start, plus the queuing
            for _ in range(args.steps):
                t0, inside[0] = time.perf_counter(), 0.0
                engine.step()
                host.append(1e3 * (time.perf_counter() - t0 - inside[0]) + queued[-1])
        finally:
            LaunchedStep.start, timing[0] = real_start, False
        med = statistics.median(measured)
        print(f"| {c} | {med:.2f} | {min(measured):.2f} | {max(measured):.2f} | {statistics.median(queued):.2f} | "
              f"{statistics.median(host):.2f} |", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(dict(model=args.model, c=c, device_ms=round(med, 3),
                                        queued_ms=round(statistics.median(queued), 3),
                                        host_ms=round(statistics.median(host), 3),
                                        all_ms=[round(x, 3) for x in measured])) + "\n")
        drain(engine)
        del engine
        mx.clear_cache()


if __name__ == "__main__":
    main()
