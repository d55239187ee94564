"""Where a decode step's time goes on a GPU: the device's and the host's events of each step on one clock.

``bench.gpu_device_step`` measures the device's time for a step from a full
queue; it does not say where in a served step the device waits. This probe
runs the engine as it serves (asynchronous, the encode thread, MLX's own CUDA
graph limits) and puts a clock kernel on the device's queue before each step
(``before``) and one after its sampling (``after``, reading the sampled
tokens); the host records, on its own clock, when the engine's thread handed
the step over (``LaunchedStep.start``), when MLX's ``mx.async_eval`` of the
step began and returned (on the encode thread), and when the engine's thread
began and ended waiting for the step's tokens. The GPU clock
(``%globaltimer``) is mapped onto the host's by the stamp with the shortest
round trip.

Per step, median over ``--steps``: the device's span (before to after), its
idle gap to the next step, and each host event against the device's; the
device's tail after MLX returned from encoding the step (near zero: the device
waited on the encoding; large: the encoding ran ahead of it).

    python -m bench.gpu_step_timeline [--levels 16,64] [--steps 40] [--built]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import numpy as np


def clock_offset(stamp, tries: int = 30) -> int:
    """The GPU clock less the host's (``perf_counter_ns``), from the synchronous stamp with the shortest
    round trip."""
    import mlx.core as mx

    best = None
    for _ in range(tries):
        h0 = time.perf_counter_ns()
        s = stamp()
        mx.eval(s)
        h1 = time.perf_counter_ns()
        if best is None or h1 - h0 < best[0]:
            best = (h1 - h0, int(s.item()) - (h0 + h1) // 2)
    return best[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--levels", default="16,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--built", action="store_true", help="steps built in Python (default: compiled decode)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--out", help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)

    import mlx.core as mx

    from mlxd.bench.gpu_device_step import STAMP_SOURCE, clock_kernels
    from mlxd.bench.gpu_serving import DEFAULT_CACHE_LIMIT, build_models, drain, engine_for, start_decoding
    from mlxd.engined.sampler import LaunchedStep

    _, stamp = clock_kernels()
    after_kernel = mx.fast.cuda_kernel(
        name="mlxd_probe_after", input_names=["after"], output_names=["stamp"], source=STAMP_SOURCE)

    def stamp_after(arr):
        return after_kernel(inputs=[arr], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                            output_dtypes=[mx.uint64])[0]

    DEFAULT_CACHE_LIMIT.append(mx.set_cache_limit(0))
    mx.set_cache_limit(DEFAULT_CACHE_LIMIT[0])
    model, make_loaded, _ = build_models(args.model, "bf16", 0)
    rng = np.random.default_rng(0)
    real_start, real_read, real_async_eval = LaunchedStep.start, LaunchedStep.read, mx.async_eval
    on = [False]
    steps: list[dict] = []  # per timed step: host events (ns, perf_counter) and its two stamps
    by_pending: dict[int, dict] = {}  # a step's record by its pending list, which the encode thread evaluates
    by_step: dict[int, dict] = {}  # and by the LaunchedStep, while it lives

    def timed_async_eval(*arrays):
        rec = by_pending.pop(id(arrays[0]), None) if arrays else None
        t0 = time.perf_counter_ns()
        real_async_eval(*arrays)
        if rec is not None:
            rec["encode0"], rec["encode1"] = t0, time.perf_counter_ns()

    def stamped_start(self, encoder=None):
        if not on[0] or self.feed is None:
            return real_start(self, encoder)
        t0 = time.perf_counter_ns()
        with mx.stream(encoder.stream) if encoder is not None else nullcontext():  # the step's own stream
            rec = dict(start=t0, before=stamp(), after=stamp_after(self.feed))
        if encoder is not None:
            encoder.submit([rec["before"]])
        else:
            real_async_eval(rec["before"])
        self._pending.append([rec["after"]])
        by_pending[id(self._pending)] = by_step[id(self)] = rec
        steps.append(rec)
        real_start(self, encoder)

    def timed_read(self):
        rec = by_step.pop(id(self), None)
        t0 = time.perf_counter_ns()
        out = real_read(self)
        if rec is not None:
            rec["read0"], rec["read1"] = t0, time.perf_counter_ns()
        return out

    print(f"decode step timeline ({args.model}, bf16, {'built' if args.built else 'compiled'}; ms, on the "
          "device's clock, from the device reaching the step)\n"
          "| c | step ms | device span | device gap | handed over | encode begins | encode ends | "
          "device tail after encode | read waits from | read ends |\n|---|---|---|---|---|---|---|---|---|---|",
          flush=True)
    for c in map(int, args.levels.split(",")):
        engine = engine_for(make_loaded, args, c, True, compile_decode=not args.built)
        start_decoding(engine, [rng.integers(0, model.args.vocab_size, 512).tolist() for _ in range(c)],
                       args.steps + 60)
        for _ in range(4):  # a compiled shape's trace and its fused kernels' compilation, untimed
            engine.step()
        if engine.encoder is not None:
            engine.encoder.wait()  # no evaluation here while the worker encodes (engined/fastpath/encode_thread.py)
        offset = clock_offset(stamp)
        by_pending.clear()
        LaunchedStep.start, LaunchedStep.read, mx.async_eval = stamped_start, timed_read, timed_async_eval
        on[0] = True
        try:
            for _ in range(3):  # the clock kernel that reads the tokens compiles at its first step: untimed
                engine.step()
            steps.clear()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            wall_ms = 1e3 * (time.perf_counter() - t0) / args.steps
            on[0] = False
            for _ in range(2):  # read the last timed steps
                engine.step()
        finally:
            LaunchedStep.start, LaunchedStep.read, mx.async_eval, on[0] = real_start, real_read, real_async_eval, False
        mx.eval([r["after"] for r in steps])
        rows = []
        for cur, nxt in zip(steps, steps[1:]):
            if not all(k in cur for k in ("encode0", "read0")):
                continue
            b = int(cur["before"].item())

            def dev(ns: int, b: int = b) -> float:
                """A host time on the device's clock, in ms from the device reaching the step."""
                return (ns + offset - b) / 1e6

            a = (int(cur["after"].item()) - b) / 1e6
            rows.append(dict(span=a, gap=(int(nxt["before"].item()) - b) / 1e6 - a, handed=dev(cur["start"]),
                             enc0=dev(cur["encode0"]), enc1=dev(cur["encode1"]), tail=a - dev(cur["encode1"]),
                             read0=dev(cur["read0"]), read1=dev(cur["read1"])))
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {c} | {wall_ms:.2f} | {med['span']:.2f} | {med['gap']:.2f} | {med['handed']:.2f} | "
              f"{med['enc0']:.2f} | {med['enc1']:.2f} | {med['tail']:.2f} | {med['read0']:.2f} | "
              f"{med['read1']:.2f} |", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(dict(model=args.model, c=c, compiled=not args.built, step_ms=round(wall_ms, 3),
                                        median={k: round(v, 3) for k, v in med.items()},
                                        steps=[{k: round(v, 3) for k, v in r.items()} for r in rows])) + "\n")
        drain(engine)
        del engine
        mx.clear_cache()


if __name__ == "__main__":
    main()
