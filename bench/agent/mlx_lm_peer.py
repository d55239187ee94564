"""mlx_lm.server with the optimized BLAS that mlxd's engine loads.

`import engined` puts OpenBLAS into the process before `mlx.core` is first
imported (see engined/__init__.py); without it mlx_lm would run MLX's
reference BLAS on this CPU and the comparison would measure BLAS, not serving.
"""

import sys

import engined  # noqa: F401  (must precede any mlx import)
from mlx_lm import server

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    sys.exit(server.main())
