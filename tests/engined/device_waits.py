"""Counting the host's waits for the device, for the tests that hold how often a step waits."""

from __future__ import annotations

import mlx.core as mx


class DeviceWaits:
    """Counts, while entered, the host's waits for the device: ``mx.eval`` and reads of an array's
    values to the host (``tolist``, ``item``, ``int``/``float``/``bool`` of one). The real functions
    run; they are only counted."""

    READS = ("tolist", "item", "__int__", "__float__", "__bool__")

    def __init__(self):
        self.count = 0
        self._saved = []

    def _wrap(self, owner, name):
        real = getattr(owner, name)
        self._saved.append((owner, name, real))

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        setattr(owner, name, counted)

    def __enter__(self):
        self._wrap(mx, "eval")
        for name in self.READS:
            self._wrap(mx.array, name)
        return self

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
