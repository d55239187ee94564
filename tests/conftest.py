"""Shared fixtures. Importing engined first loads the optimized BLAS before mlx.core (engined/backend.py)."""

import engined  # noqa: F401
