"""A long step is not a dead engine: pings are answered while the engine thread is inside one step."""

from __future__ import annotations

import threading
import time

import zmq

from mlxd.engined.daemon import Daemon
from mlxd.engined.engine import Engine
from mlxd.shared import protocol as p
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import Kind, SamplingParams
from tests.tiny_models import make_tiny_model

HOLD_S = 20.0  # the longest the step is held: far past any ping's answer, were it answered


def test_pings_are_answered_while_a_step_runs_for_many_seconds(tmp_path):
    engine = Engine(EngineConfig(model=str(make_tiny_model(tmp_path / "m", "llama", seed=1)),
                                 num_kv_blocks=64, max_model_len=256))
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.step

    def long_step():
        # The step held as a 6K-token prefill on a slow CPU holds it, until the test has its answer.
        in_step.set()
        release.wait(HOLD_S)
        return real_step()

    engine.step = long_step
    daemon = Daemon(engine, f"ipc://{tmp_path}/engine.sock", gateway_timeout=60.0)
    runner = threading.Thread(target=daemon.run, daemon=True)
    runner.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(daemon.endpoint)
    try:
        dealer.send_multipart(p.encode(Kind.HELLO, p.Hello(protocol_version=p.PROTOCOL_VERSION, pid=0)))
        assert dealer.poll(10_000) and p.decode(dealer.recv_multipart())[0] is Kind.READY
        dealer.send_multipart(p.encode(Kind.ADD, p.AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=2))))
        assert in_step.wait(10)
        pong = None
        deadline = time.monotonic() + HOLD_S / 2
        while pong is None and time.monotonic() < deadline and not release.is_set():
            dealer.send_multipart(p.encode(Kind.PING, p.Ping(time.time())))
            if dealer.poll(500):
                kind, msg = p.decode(dealer.recv_multipart())
                if kind is Kind.PONG:
                    pong = msg
        answered_in_step = pong is not None and not release.is_set()
        release.set()
        assert answered_in_step, "no PONG while the step ran"
        assert pong.instance_id == daemon.instance_id
        # The request still completes once the step is over.
        finished = False
        deadline = time.monotonic() + 30
        while not finished and time.monotonic() < deadline:
            if dealer.poll(500):
                kind, msg = p.decode(dealer.recv_multipart())
                finished = kind is Kind.OUTPUTS and any(o.finish_reason for o in msg.outputs)
        assert finished
    finally:
        release.set()
        dealer.close()  # before the daemon terminates the process's shared context
        daemon.request_stop("test over")
        runner.join(30)
    assert not runner.is_alive()
