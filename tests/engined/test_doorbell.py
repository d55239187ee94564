"""Where a worker finds rank 0's wake socket (engined/parallel/doorbell.py): the address the launcher gave the ranks."""

from __future__ import annotations

import json

import pytest

from mlxd.engined.parallel.doorbell import rank0_host


@pytest.mark.parametrize("hosts,expected", [
    ([["10.0.0.1:5000", "10.0.1.1:5001"], ["10.0.0.2:5002"]], "10.0.0.1"),  # mlx.launch's: rank 0's first address
    ([["[fe80::1]:5000"], ["[fe80::2]:5000"]], "fe80::1"),
])
def test_rank_0_is_the_first_host_of_the_ring_host_file(tmp_path, monkeypatch, hosts, expected):
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(hosts))
    monkeypatch.setenv("MLX_HOSTFILE", str(path))
    monkeypatch.delenv("MLX_JACCL_COORDINATOR", raising=False)
    assert rank0_host() == expected


def test_rank_0_is_jaccls_coordinator(monkeypatch):
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "192.168.1.10:32323")
    assert rank0_host() == "192.168.1.10"


def test_no_address_and_an_unreadable_host_file_give_none(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_JACCL_COORDINATOR", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    assert rank0_host() is None  # another backend (MPI, NCCL): idle workers poll
    monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "missing.json"))
    assert rank0_host() is None
