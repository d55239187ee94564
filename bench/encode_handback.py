"""How long the encode thread's worker sits in ``mx.async_eval`` while the engine's thread is busy in Python.

``mx.async_eval`` lets go of Python's lock while MLX encodes, and takes it back
to return. The engine's thread, meanwhile building the next step in Python,
gives the lock up only when it blocks or when the interpreter's switch
interval runs out (5 ms by default), so the worker's time around the call (what
``EncodeThread.encode_s`` counts) stretches to that. ``engined/fastpath/encode_thread.py``
shortens the interval (``SWITCH_INTERVAL_S``); this probe measures both in one
run, alternating: the worker encodes a chain of ``--ops`` additions while the
main thread spins ``--python-ms`` of pure Python, then waits for it.

    python -m bench.encode_handback [--seconds 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def worker_wall(interval_s: float, seconds: float, ops: int, python_ms: float) -> tuple[float, int]:
    """Median seconds of the worker's ``mx.async_eval`` of one graph, and how many graphs were timed."""
    import mlx.core as mx

    from engined.fastpath.encode_thread import EncodeThread

    encoder = EncodeThread()
    sys.setswitchinterval(interval_s)  # after the thread set its own
    x = mx.ones((64, 64))
    mx.eval(x)
    laps = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        with mx.stream(encoder.stream):
            y = x
            for _ in range(ops):
                y = y + 1
        before = encoder.encode_s
        encoder.submit([y])
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < python_ms / 1e3:  # the engine's thread building the next step
            pass
        encoder.wait()
        laps.append(encoder.encode_s - before)
    return statistics.median(laps), len(laps)


def main(argv=None) -> None:
    from engined.fastpath.encode_thread import SWITCH_INTERVAL_S

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ops", type=int, default=50, help="additions in each graph")
    ap.add_argument("--python-ms", type=float, default=3.0, help="the main thread's Python per graph")
    args = ap.parse_args(argv)
    default = sys.getswitchinterval()
    got: dict[float, list[float]] = {default: [], SWITCH_INTERVAL_S: []}
    for r in range(args.rounds):
        for interval in (list(got) if r % 2 == 0 else list(got)[::-1]):
            wall, n = worker_wall(interval, args.seconds, args.ops, args.python_ms)
            got[interval].append(wall)
            print(f"round {r}: switch interval {1e3 * interval:.2f} ms: the worker's mx.async_eval "
                  f"{1e3 * wall:.3f} ms (median of {n})", flush=True)
    sys.setswitchinterval(default)
    old, new = (statistics.median(got[k]) for k in (default, SWITCH_INTERVAL_S))
    print(f"| switch interval | worker ms a graph |\n|---|---|\n| {1e3 * default:.2f} ms (default) | {1e3 * old:.3f} |\n"
          f"| {1e3 * SWITCH_INTERVAL_S:.2f} ms (EncodeThread) | {1e3 * new:.3f} |\nratio {old / new:.1f}x")


if __name__ == "__main__":
    main()
