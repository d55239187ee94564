"""The engine's socket spoken to directly: bad frames are dropped, bad requests refused, never fatal."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from mlxd.shared import protocol as p
from mlxd.shared.protocol import Kind, SamplingParams


@pytest.fixture
def dealer(engine, gateway):  # the gateway fixture guarantees the engine has loaded
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(engine.endpoint)
    yield s
    s.send_multipart(p.encode(Kind.BYE, p.Bye()))
    s.close()


def _recv(s, timeout=10.0):
    assert s.poll(int(timeout * 1000)), "no answer from the engine"
    return p.decode(s.recv_multipart())


def _ping(s) -> p.Pong:
    s.send_multipart(p.encode(Kind.PING, p.Ping(time.time())))
    while True:
        kind, msg = _recv(s)
        if kind is Kind.PONG:
            return msg


def test_handshake_gives_engine_info(dealer):
    dealer.send_multipart(p.encode(Kind.HELLO, p.Hello(protocol_version=p.PROTOCOL_VERSION)))
    kind, info = _recv(dealer)
    assert kind is Kind.READY
    assert info.protocol_version == p.PROTOCOL_VERSION and info.max_model_len == 512
    assert info.vocab_size > 0 and info.eos_token_ids and info.num_kv_blocks == 160


def test_protocol_mismatch_is_refused_with_a_clear_error(dealer):
    dealer.send_multipart(p.encode(Kind.HELLO, p.Hello(protocol_version=p.PROTOCOL_VERSION + 99)))
    kind, err = _recv(dealer)
    assert kind is Kind.ERROR and err.request_id is None and err.code == "protocol_mismatch"
    assert str(p.PROTOCOL_VERSION) in err.message


@pytest.mark.parametrize("frames", [
    [b"\xff", b"junk"],  # unknown kind
    [Kind.ADD.value, b"\x01\x02\x03"],  # payload that is not an AddRequest
    [Kind.ADD.value, msgspec.msgpack.encode(["id", "not a list", {}])],
    [Kind.ABORT.value],  # missing payload
    [Kind.PING.value, b"", b"extra"],  # too many frames
    [b"", b""],
])
def test_malformed_frames_are_dropped_and_the_engine_keeps_serving(dealer, frames):
    dealer.send_multipart(frames)
    pong = _ping(dealer)
    assert pong.stats.num_total_blocks == 160


def _add(s, rid, prompt, **params):
    s.send_multipart(p.encode(Kind.ADD, p.AddRequest(rid, prompt, SamplingParams(**params))))


def test_invalid_requests_get_errors_with_codes_and_valid_ones_run(dealer):
    _add(dealer, "bad-params", [1, 2, 3], max_tokens=0)
    _add(dealer, "bad-ids", [10**9], max_tokens=2)
    _add(dealer, "too-long", [5] * 600, max_tokens=2)
    _add(dealer, "good", [1, 2, 3, 4], max_tokens=3, temperature=0.0)
    _add(dealer, "good", [1, 2, 3, 4], max_tokens=3, temperature=0.0)  # duplicate id in flight
    errors, tokens, finished = {}, [], None
    deadline = time.monotonic() + 60
    while (len(errors) < 4 or finished is None) and time.monotonic() < deadline:
        kind, msg = _recv(dealer)
        if kind is Kind.ERROR:
            errors.setdefault(msg.request_id, []).append(msg.code)
        elif kind is Kind.OUTPUTS:
            for out in msg.outputs:
                assert out.request_id == "good"
                tokens += out.new_token_ids
                finished = out.finish_reason or finished
    assert errors["bad-params"] == ["invalid_request"]
    assert errors["bad-ids"] == ["invalid_request"]
    assert errors["too-long"] == ["context_length_exceeded"]
    assert errors["good"] == ["invalid_request"]
    assert finished in ("stop", "length") and 1 <= len(tokens) <= 3


def test_abort_frees_the_blocks_at_once(dealer):
    _add(dealer, "long", list(range(100, 140)), max_tokens=300, ignore_eos=True, temperature=0.0)
    while True:
        kind, msg = _recv(dealer)
        if kind is Kind.OUTPUTS and sum(len(o.new_token_ids) for o in msg.outputs) > 0:
            break
    assert _ping(dealer).stats.num_running == 1
    dealer.send_multipart(p.encode(Kind.ABORT, p.Abort(["long"])))
    stats = _ping(dealer).stats
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_a_long_step_does_not_make_a_pinging_gateway_look_gone(tmp_path):
    """Pings queued during a multi-second prefill step count: the request is not aborted."""
    from tests.e2e.servers import Engine, free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = Engine(endpoint, str(tmp_path / "engine.log"),
                    extra=["--gateway-timeout", "0.5", "--max-model-len", "1024",
                           "--max-num-batched-tokens", "1024"]).start()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart(p.encode(Kind.HELLO, p.Hello(protocol_version=p.PROTOCOL_VERSION)))
        kind, _ = _recv(s, timeout=180)
        assert kind is Kind.READY
        # ~700 prompt tokens in one prefill step: seconds on a CPU, far over the 0.5 s timeout.
        _add(s, "long-prefill", list(range(1000, 1700)), max_tokens=2, temperature=0.0)
        finished, errors = None, []
        deadline = time.monotonic() + 120
        while finished is None and not errors and time.monotonic() < deadline:
            s.send_multipart(p.encode(Kind.PING, p.Ping(time.time())))
            if not s.poll(100):
                continue
            kind, msg = p.decode(s.recv_multipart())
            if kind is Kind.OUTPUTS:
                finished = next((o.finish_reason for o in msg.outputs if o.finish_reason), None)
            elif kind is Kind.ERROR:
                errors.append(msg)
        assert errors == [] and finished == "length"
    finally:
        s.close()
        engine.stop()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_gateway_that_never_reads_is_cut_off_and_its_requests_aborted(tmp_path):
    """It writes (so it never looks silent) but reads nothing: its queue stays bounded, its PONGs are
    dropped, then it is treated as gone; a reading gateway beside it is served throughout."""
    from tests.e2e.servers import Engine, free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path / "engine.log"
    engine = Engine(endpoint, str(log_path)).start()
    ctx = zmq.Context.instance()
    mute, healthy = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (mute, healthy):
        s.setsockopt(zmq.LINGER, 0)
    # Its own buffers small, so the engine's side fills after a few thousand frames.
    mute.setsockopt(zmq.RCVHWM, 1)
    mute.setsockopt(zmq.RCVBUF, 4096)
    mute.connect(endpoint)
    healthy.connect(endpoint)
    try:
        healthy.send_multipart(p.encode(Kind.HELLO, p.Hello(protocol_version=p.PROTOCOL_VERSION)))
        assert _recv(healthy, timeout=180)[0] is Kind.READY
        rss_before = _rss_mb(engine.proc.pid)
        mute.send_multipart(p.encode(Kind.HELLO, p.Hello(protocol_version=p.PROTOCOL_VERSION)))
        _add(mute, "mute-long", [1, 2, 3, 4], max_tokens=500, ignore_eos=True, temperature=0.0)
        sent = 0
        while "stopped reading" not in log_path.read_text():
            for _ in range(1000):
                mute.send_multipart(p.encode(Kind.PING, p.Ping(time.time())))
            sent += 1000
            assert sent <= 300_000, "300k unread PINGs and the gateway still counts as reading"
            assert _ping(healthy).stats.num_total_blocks > 0  # the reading gateway is answered meanwhile
        stats = _ping(healthy).stats
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
        text = log_path.read_text()
        assert "does not read" in text and "aborted 1 request(s)" in text.split("stopped reading", 1)[1]
        print(f"cut off after {sent} unread PINGs; engine RSS {rss_before:.1f} -> {_rss_mb(engine.proc.pid):.1f} MB")
    finally:
        mute.close()
        healthy.close()
        engine.stop()
