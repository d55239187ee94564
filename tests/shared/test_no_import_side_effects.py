"""Importing any of mlxd's packages changes nothing in the process: no environment, no libraries.

The engine process loads its BLAS when it starts (engined/device.py), the
attention implementation is a setting (--attention-backend), and the hub is
read offline by argument (shared/hub.py), never through variables set on the way.
"""

from __future__ import annotations

import json
import subprocess
import sys

MODULES = ["mlxd.engined", "mlxd.engined.engine", "mlxd.engined.daemon", "mlxd.engined.process", "mlxd.engined.device",
           "mlxd.engined.loaders", "mlxd.engined.structured", "mlxd.engined.kernels", "mlxd.gateway.params",
           "mlxd.gateway.server", "mlxd.cli", "mlxd.serve", "mlxd.supervisor", "mlxd.service.managers", "mlxd.shared.hub"]

PROBE = """
import json, os, sys
before = dict(os.environ)
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
maps = open("/proc/self/maps").read()
print(json.dumps({"changed": sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)),
                  "openblas": "libopenblas" in maps}))
"""


def test_importing_the_packages_sets_no_variable_and_loads_no_blas():
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("OPENBLAS_THREAD_TIMEOUT", "HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "MLXD_ATTENTION")}
    r = subprocess.run([sys.executable, "-c", PROBE, *MODULES], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # mlx_lm's own __init__ sets this one; mlxd sets none.
    assert [k for k in out["changed"] if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"] == []
    assert out["openblas"] is False


def test_the_attention_backend_is_a_setting_with_the_kernels_names():
    from mlxd.engined import kernels
    from mlxd.shared.config import ATTENTION_BACKENDS, EngineConfig
    from mlxd.shared.errors import InvalidRequestError

    assert ATTENTION_BACKENDS == kernels.BACKENDS
    assert EngineConfig(attention_backend="reference").attention_backend == "reference"
    try:
        EngineConfig(attention_backend="fast")
    except InvalidRequestError as e:
        assert e.param == "attention_backend"
    else:
        raise AssertionError("an unknown attention backend was accepted")
    assert kernels.resolve_backend("reference") == "reference"
