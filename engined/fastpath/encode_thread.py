"""A launched step's graph encoded on a thread of its own, while the engine's thread builds the next.

A decode step on a GPU is bound by the host, in two parts that otherwise run
one after the other on one thread: Python building the step's graph, and MLX
encoding that graph into kernel launches inside ``mx.async_eval`` (about half
each at 64 rows on the H200, ``bench/gpu_op_costs.py``). ``mx.async_eval``
lets go of Python's lock while it encodes, so here it runs on a worker: the
engine hands over a built step and goes on to postprocess the step before,
schedule and build the next.

The engine builds its steps on a stream that any thread may evaluate
(``mx.new_thread_unsafe_stream``); MLX leaves it to its user that no two
evaluations overlap where they share arrays (an evaluation walks its graph's
inputs and detaches those already computed). So the worker encodes one graph
at a time, and the engine's thread evaluates no graph while it does; it waits
(``wait``) before anything it evaluates: resizing the KV pools, sampling a
trial row. Reading the step in flight while the worker encodes the next
(``Engine.step`` hands the next over first, so the device goes from one to the
other without waiting) only waits on arrays that step already computed, none
of which the next step's graph holds: the next step's placeholders read the
sampled tokens through an array of their own (``LaunchedStep.feed``), and a
pooled request's result is computed with its step. Building a graph reads only
arrays' shapes and types, which an evaluation does not change.

The worker needs Python's lock back to leave ``mx.async_eval``, and the
engine's thread, busy in Python, gives it up only when it blocks or when the
interpreter's switch interval runs out (5 ms by default). The worker would sit
that long after each step's encoding: nothing waits on it then, but its encode
time (``encode_s``) would count the wait. The thread shortens the interval to
``SWITCH_INTERVAL_S`` for the process (``bench/encode_handback.py`` measures
the worker's time around ``mx.async_eval`` at both).
"""

from __future__ import annotations

import sys
import threading
import time

import mlx.core as mx

SWITCH_INTERVAL_S = 2e-4


class EncodeThread:
    def __init__(self):
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.stream = mx.new_thread_unsafe_stream(mx.default_device())
        self._cond = threading.Condition()
        self._arrays: list | None = None  # the graph handed over, until the worker takes it
        self._started = True
        self._submitted = 0  # graphs handed over
        self._encoded = 0  # graphs the worker has finished with
        self._error: tuple[int, BaseException] | None = None
        self.encode_s = 0.0  # seconds the worker has spent encoding (benchmarks set it against the step's)
        threading.Thread(target=self._run, name="mlxd-encode", daemon=True).start()

    def submit(self, arrays: list) -> int:
        """Encode ``arrays``' graph (``mx.async_eval``) on the worker, after the graph handed over before;
        returns its number for ``wait``."""
        with self._cond:
            self._cond.wait_for(lambda: self._encoded == self._submitted)
            self._submitted += 1
            self._arrays, self._started = arrays, False
            self._cond.notify_all()
            # Waiting here lets the worker take Python's lock at once and enter MLX, which gives it back;
            # otherwise it would wait for this thread's switch interval (5 ms) to start.
            self._cond.wait_for(lambda: self._started)
            return self._submitted

    def wait(self, number: int | None = None) -> None:
        """Return once graph ``number`` (default: the last handed over) is encoded, queued on the device;
        raise what encoding it raised."""
        with self._cond:
            number = self._submitted if number is None else number
            self._cond.wait_for(lambda: self._encoded >= number)
            if self._error is not None and self._error[0] <= number:
                error, self._error = self._error[1], None
                raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._arrays is not None)
                arrays, self._arrays, self._started = self._arrays, None, True
                number = self._submitted
                self._cond.notify_all()
            t0 = time.perf_counter()
            try:
                mx.async_eval(arrays)
            except BaseException as e:  # raised on the engine's thread by its wait for this graph
                self._error = (number, e)
            self.encode_s += time.perf_counter() - t0
            # Hold no array past its encoding: the next step's K/V writes reuse the pools' buffers only
            # where nothing else refers to them.
            del arrays
            with self._cond:
                self._encoded += 1
                self._cond.notify_all()
