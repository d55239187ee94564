"""``bench/pipeline.py``'s serving levels, as the two-GPU run makes them, on CPU ranks over loopback: a row per
configuration and level, and every request's greedy tokens equal to one rank's."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(600)
def test_the_serving_levels_give_a_row_per_configuration_and_level_with_one_ranks_tokens():
    out = subprocess.run(
        [sys.executable, "-m", "mlxd.bench.pipeline", "--shape", "llama-tiny", "--configs",
         "1 rank,tensor x2,pipeline x2", "--concurrency", "1,3", "--max-tokens", "6", "--num-kv-blocks", "512",
         "--seed", "3"], capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\| (1 rank|tensor x2|pipeline x2) \| (\d+) \|.*\| (\d+)/(\d+)(?: \(token \d+\))? \|$",
                      out.stdout, re.M)
    assert sorted((name, c) for name, c, _, _ in rows) == sorted(
        (name, c) for name in ("1 rank", "tensor x2", "pipeline x2") for c in ("1", "3")), out.stdout
    for name, c, same, total in rows:
        assert same == total == c, f"{name} at c = {c}: {same}/{total} requests equal\n{out.stdout}"
