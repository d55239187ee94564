"""mlx_lm.server with the optimized BLAS that mlxd's engine loads.

``load_fast_blas`` puts OpenBLAS into the process before `mlx.core` is first
imported (see engined/device.py); without it mlx_lm would run MLX's
reference BLAS on this CPU and the comparison would measure BLAS, not serving.
"""

import sys

if __name__ == "__main__":
    from mlxd.engined.device import load_fast_blas

    load_fast_blas()  # must precede any mlx import
    from mlx_lm import server

    sys.argv[0] = "mlx_lm.server"
    sys.exit(server.main())
