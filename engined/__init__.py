"""The engine daemon: scheduler, block pool, model runner, loaders, sampler."""

from engined.backend import load_fast_blas

# Must run before anything imports mlx.core; see engined/backend.py.
load_fast_blas()
