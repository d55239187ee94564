"""Benchmarks: mlxd against its peers, on the same model and machine, in the same run."""
