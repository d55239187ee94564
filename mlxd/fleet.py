"""`mlxd serve` with several models: an engine process per model, started, restarted, and (with
``--keep-alive``) started on demand and stopped when idle, within one memory budget.

The fleet lives in the serve process beside the gateway and is polled from the gateway's loop,
as the one-engine supervisor is: the decisions need both what the gateway alone knows (which
model a request names, how long each has been idle) and what serve alone owns (the engine
processes), and a call within one process needs no channel, no protocol and no second failure
mode. The gateway sees it through ``gateway.state.Fleet`` (``want``, ``stopped``) and
never imports it.

Each model's engine is an ``EngineSupervisor`` (mlxd/supervisor.py): restarted with a growing delay
when it dies. One that fails to load, or keeps dying, is given up alone: its requests get a 503
saying so, the other models go on.

On demand: no engine starts with serve. A request for a stopped model starts its engine (the
request waits for its READY); an engine with no request open for ``--keep-alive`` seconds is
stopped. The models in memory are held under a budget (``--gpu-memory-utilization`` of the
machine's memory, for the whole set): a model's share is its weights' size on disk plus its
``kv_cache_memory`` when set. A model that does not fit stops idle models, least recently used
first, and starts once they have exited; if only busy models hold the budget its request gets a
503 saying which.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mlxd.model_set import ModelPlan, plan_models
from mlxd.shared.config import EngineConfig
from mlxd.shared.serve_config import DaemonConfig, ModelSetConfig
from mlxd.supervisor import EngineSupervisor, check_model_path, engine_argv


def weights_bytes(model: str) -> int:
    """Bytes of a model's weights on disk (a file, or a directory's .safetensors/.gguf files); 0 if unknown."""
    path = Path(model).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".safetensors", ".gguf"))
    return 0


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass
class Member:
    plan: ModelPlan
    argv: list[str]
    cost: int
    supervisor: EngineSupervisor | None = None
    # "stopped", "running" (started, loading or serving), "stopping" (told to exit after --keep-alive).
    state: str = "stopped"
    # Why it is given up (failed to load, crash loop); None while it may run.
    failed: str | None = None
    # A request waits for it to start once the models being stopped for it have exited.
    pending: bool = False
    # Seconds since its last request, as the gateway said at the last poll (0 while one is open).
    idle: float = 0.0


def build_fleet(engine_cfg: EngineConfig, daemon_cfg: DaemonConfig, models: list[str], model_set: ModelSetConfig,
                log_level: str) -> tuple["Fleet", list[DaemonConfig]]:
    """The fleet of serve's models (mlxd/model_set.py), and each engine's DaemonConfig."""
    plans = plan_models(engine_cfg, daemon_cfg, models, model_set.models_file)
    members = []
    for p in plans:
        check_model_path(p.engine.model)
        members.append(Member(p, engine_argv(p.engine, p.daemon, log_level),
                              weights_bytes(p.engine.model) + (p.engine.kv_cache_memory or 0)))
    budget = int(engine_cfg.gpu_memory_utilization * machine_memory())
    return Fleet(members, model_set.keep_alive, budget), [p.daemon for p in plans]


class Fleet:
    def __init__(self, members: list[Member], keep_alive: float | None, budget: int):
        self.members = {m.plan.name: m for m in members}
        # The gateway's --model-endpoints.
        self.endpoint_entries = [m.plan.endpoint_entry for m in members]
        self.keep_alive = keep_alive
        self.on_demand = keep_alive is not None
        self.budget = budget
        self.stop_requested = False

    def start(self) -> None:
        if not self.on_demand:
            for m in self.members.values():
                self._start(m)

    def _start(self, m: Member) -> None:
        m.supervisor = EngineSupervisor(m.argv)
        m.supervisor.start()
        m.state, m.pending, m.idle = "running", False, 0.0
        print(f"mlxd: starting the engine of {m.plan.name}", file=sys.stderr, flush=True)

    def _held(self) -> int:
        return sum(m.cost for m in self.members.values() if m.state != "stopped")

    # -- asked by the gateway (gateway.state.Fleet) -------------------------------------

    def want(self, name: str) -> str | None:
        """None: the request waits (the engine runs, or starts now, or once the idle models stopped for
        it have exited); else why it cannot start (it was given up, or busy models hold the budget)."""
        m = self.members[name]
        if m.failed is not None:
            return m.failed
        if m.state == "running" or m.pending:
            return None  # loading, or waiting for the models stopped for it to exit
        m.pending = True
        if m.state == "stopping":
            return None
        need = self._held() + m.cost - self.budget
        if need <= 0:
            self._start(m)
            return None
        idle = sorted((o for o in self.members.values() if o.state == "running" and o.idle > 0),
                      key=lambda o: -o.idle)
        if sum(o.cost for o in idle) < need:
            m.pending = False
            busy = [o.plan.name for o in self.members.values() if o.state != "stopped" and o not in idle]
            return (f"it needs {_gb(m.cost)} and {_gb(self._held())} of the {_gb(self.budget)} memory budget "
                    f"are held by models in use ({', '.join(busy)}); try again when they are idle")
        for o in idle:
            if need <= 0:
                break
            print(f"mlxd: stopping {o.plan.name} (idle {o.idle:.0f}s) to make room for {name}", file=sys.stderr,
                  flush=True)
            self._unload(o)
            need -= o.cost
        return None

    def stopped(self, name: str) -> bool:
        m = self.members[name]
        return m.failed is None and m.state == "stopped"

    # -- polled from the gateway's loop ---------------------------------------------------------

    def poll(self, idle: dict[str, float]) -> int | None:
        """Check on every engine with each model's idle seconds (0 while a request is open); serve's
        exit code once every model is given up, else None."""
        if self.stop_requested:
            return 0
        for name, m in self.members.items():
            m.idle = idle.get(name, 0.0)
            if m.state == "running" and m.failed is None:
                code = m.supervisor.poll()
                if code is not None:
                    m.failed = f"its engine was given up (exit code {code}; see the server's log)"
                    m.supervisor.stop(0)
                    m.state = "stopped"
                elif (self.on_demand and m.supervisor.ever_ready and m.idle >= self.keep_alive
                      and m.supervisor.process.poll() is None):
                    print(f"mlxd: stopping {name}: idle for {m.idle:.0f}s (--keep-alive {self.keep_alive:g})",
                          file=sys.stderr, flush=True)
                    self._unload(m)
            if m.state == "stopping" and m.supervisor.process.poll() is not None:
                m.supervisor.stop(0)
                m.state = "stopped"
        for m in self.members.values():
            if m.pending and m.state == "stopped" and self._held() + m.cost <= self.budget:
                self._start(m)
        if all(m.failed is not None for m in self.members.values()):
            return 1
        return None

    def _unload(self, m: Member) -> None:
        m.supervisor.begin_stop()
        m.state = "stopping"

    def begin_stop(self) -> None:
        for m in self.members.values():
            if m.supervisor is not None:
                m.supervisor.begin_stop()

    def stop(self, timeout: float) -> None:
        for m in self.members.values():
            if m.supervisor is not None:
                m.supervisor.stop(timeout)
