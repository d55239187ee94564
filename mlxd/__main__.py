"""`python -m mlxd`: the `mlxd` command (how the service units and `mlxd serve` start processes)."""

import sys

from mlxd.cli import main

if __name__ == "__main__":
    sys.exit(main())
