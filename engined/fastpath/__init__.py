"""The GPU fast path: less host work per step, where a GPU's decode step is bound by the host.

Plugs into the runner as it runs a decode step (``compiled_decode`` replays a traced graph), and
into the engine's launch (``encode_thread`` encodes a launched step on a thread of its own). Each
keeps the step's results as they were.
"""
