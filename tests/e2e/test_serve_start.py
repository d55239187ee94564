"""`mlxd serve` refuses a model path that does not exist in one line, before it starts anything."""

from __future__ import annotations

import pytest

from tests.e2e.serve_harness import Serve


@pytest.mark.parametrize("name", ["missing.gguf", "missing-dir"])
def test_a_model_path_that_does_not_exist_is_one_line_before_anything_starts(tmp_path, name):
    path = str(tmp_path / name)
    serve = Serve(tmp_path, model=path).start()
    try:
        assert serve.wait(60) == 2
        # The whole output: no engine started (it would log its load), no gateway line.
        assert serve.log().strip() == f"mlxd: {path}: no such file or directory", serve.log()
    finally:
        serve.stop()
