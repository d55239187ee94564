"""The fleet's memory budget (mlxd/fleet.py) over real child processes that stand for engines (each
says it serves on its ready pipe, as `mlxd engine` does, and runs until stopped): a model that fits
starts; one that does not stops idle models, least recently used first, and starts once they have
exited; one that only busy models keep out is refused, naming them."""

from __future__ import annotations

import sys
import time

from mlxd.fleet import Fleet, Member
from mlxd.model_set import ModelPlan
from mlxd.shared.config import EngineConfig
from mlxd.shared.serve_config import DaemonConfig

# `--ready-fd N` comes last on the command line (EngineSupervisor.start).
SERVES = "import os, sys, time; os.write(int(sys.argv[-1]), b'1'); time.sleep(600)"


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
