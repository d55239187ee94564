"""The engine daemon. Its top level is the spine every step runs: engine, scheduler, runner, sampler,
request, ``kv/``, ``kernels/``, ``loaders/`` and the model's layers, with the process, daemon, memory
guard, metrics, device and structured-output modules every engine runs. Each optional capability is a
wing of its own, whose opening docstring says where it plugs into the step: ``speculation/``,
``encoders/``, ``parallel/``, ``fastpath/``, ``lora/``.

Importing it does nothing else: the engine process loads its BLAS when it
starts (``engined.device.load_fast_blas``, called from ``run_engine``).
"""
