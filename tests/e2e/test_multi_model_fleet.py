"""A set of models as serve plans it (mlxd/model_set.py: each model's flags, name, endpoint and
metrics port) and the fleet's memory budget (mlxd/fleet.py) over real child processes that stand for
engines (each says it serves on its ready pipe, as `mlxd engine` does, and runs until stopped): a
model that fits starts; one that does not stops idle models, least recently used first, and starts
once they have exited; one that only busy models keep out is refused, naming them."""

from __future__ import annotations

import json
import sys
import time

import pytest

from mlxd.fleet import Fleet, Member
from mlxd.model_set import ModelPlan, plan_models
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.config import EngineConfig
from mlxd.shared.serve_config import DaemonConfig

# `--ready-fd N` comes last on the command line (EngineSupervisor.start).
SERVES = "import os, sys, time; os.write(int(sys.argv[-1]), b'1'); time.sleep(600)"


def test_each_model_gets_its_flags_over_the_command_lines_a_name_an_endpoint_and_a_metrics_port(tmp_path):
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"models": [{"model": "/m/a.gguf", "kv-cache-memory": "1G"},
                                           {"model": "org/b", "max_model_len": 512, "served_model_name": "bee",
                                            "gpu_memory_utilization": 0.5}]}))
    base = EngineConfig(max_model_len=256, num_kv_blocks=64)
    daemon = DaemonConfig(engine_endpoint="ipc:///run/engine.sock", metrics_port=9400)
    plans = plan_models(base, daemon, ["/m/c.gguf"], str(path))
    assert [p.name for p in plans] == ["c", "a", "bee"]
    assert [p.engine.served_model_name for p in plans] == ["c", "a", "bee"]
    assert [(p.engine.max_model_len, p.engine.num_kv_blocks) for p in plans] == [(256, 64), (256, 64), (512, 64)]
    assert plans[1].engine.kv_cache_memory == 2**30 and plans[0].engine.kv_cache_memory is None
    # The machine's memory shared among the engines, unless a model sets its own fraction.
    assert [p.engine.gpu_memory_utilization for p in plans] == [0.3, 0.3, 0.5]
    assert [p.daemon.engine_endpoint for p in plans] == [f"ipc:///run/engine-{n}.sock" for n in range(3)]
    assert [p.daemon.metrics_port for p in plans] == [9400, 9401, 9402]
    assert plans[2].endpoint_entry == "bee=ipc:///run/engine-2.sock"
    path.write_text(json.dumps([{"model": "/m/a.gguf", "max_tokens": 3}]))
    with pytest.raises(InvalidRequestError, match="unknown setting 'max_tokens'"):
        plan_models(base, daemon, [], str(path))
    with pytest.raises(InvalidRequestError, match="one name"):
        plan_models(base, daemon, ["/m/a.gguf", "/n/a.gguf"], None)


def member(name: str, cost: int) -> Member:
    plan = ModelPlan(name, EngineConfig(model=name), DaemonConfig(engine_endpoint=f"ipc:///nowhere/{name}"))
    return Member(plan, [sys.executable, "-c", SERVES], cost)


def running(fleet: Fleet) -> set[str]:
    return {n for n, m in fleet.members.items() if m.state == "running"}


def poll_until(fleet: Fleet, idle: dict, done, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert fleet.poll(idle) is None
        assert time.monotonic() < deadline, {n: (m.state, m.failed) for n, m in fleet.members.items()}
        time.sleep(0.05)


def test_a_model_that_does_not_fit_stops_idle_ones_or_names_the_busy_ones_holding_the_budget():
    fleet = Fleet([member("a", 60), member("b", 60), member("c", 30)], keep_alive=100.0, budget=100)
    try:
        fleet.start()
        assert running(fleet) == set() and all(fleet.stopped(n) for n in "abc")
        assert fleet.want("a") is None and running(fleet) == {"a"}
        busy = {"a": 0.0, "b": 0.0, "c": 0.0}
        poll_until(fleet, busy, lambda: fleet.members["a"].supervisor.ever_ready)
        # a is busy: b cannot fit beside it, c can.
        reason = fleet.want("b")
        assert reason is not None and "in use (a)" in reason, reason
        assert fleet.want("c") is None and running(fleet) == {"a", "c"}
        # a idle longest, c idle a little: b stops a alone (enough room), and starts once a has exited.
        idle = {"a": 5.0, "b": 0.0, "c": 1.0}
        fleet.poll(idle)
        assert fleet.want("b") is None
        assert fleet.want("b") is None  # asked again while a stops (a waiting request asks each tick)
        poll_until(fleet, idle, lambda: running(fleet) == {"b", "c"})
        assert fleet.stopped("a") and not fleet.stopped("b")
    finally:
        fleet.stop(1.0)
