"""The engine daemon: scheduler, block pool, model runner, loaders, sampler.

Importing it does nothing else: the engine process loads its BLAS when it
starts (``engined.device.load_fast_blas``, called from ``run_engine``).
"""
