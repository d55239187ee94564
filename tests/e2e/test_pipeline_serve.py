"""`mlxd serve -pp 2` on the embedded SmolLM2: the OpenAI SDK sees one model; an idle worker rank waits
without using a core; a rank that dies or stops answering ends the requests in flight with an error, and the
supervisor brings every rank back."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import openai
import pytest
from transformers import AutoTokenizer

from mlxd.engined.engine import Engine
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.e2e.serve_harness import Serve, gone

FLAGS = ["--pipeline-parallel-size", "2", "--pipeline-timeout", "6", "--num-kv-blocks", "96",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--max-model-len", "1024"]
PROMPT = "The three primary colors are"
# Past two KV blocks of 16 tokens: a second request finds them cached.
LONG_PROMPT = ("A pipeline splits a model's layers over several machines; each holds only its own layers "
               "and their cache. " * 2 + PROMPT)


def _ranks(serve: Serve) -> tuple[int, int]:
    """(rank 0's pid: serve's engine child, rank 1's pid: the engine's own child)."""
    engine = serve.wait_engine()
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(["pgrep", "-P", str(engine)], capture_output=True, text=True).stdout.split()
        if out:
            return engine, int(out[0])
        assert time.monotonic() < deadline, serve.log()[-3000:]
        time.sleep(0.2)


@pytest.fixture
def serve(tmp_path):
    s = Serve(tmp_path, *FLAGS).start()
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def _client(serve: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="x", max_retries=0, timeout=120)


# The most of one core an idle worker may use. MLX's ring backend polls its sockets while a receive is
# pending, so a worker waiting in mx.distributed.recv for rank 0's next message used 99 % of a core here;
# one resting in the OS uses next to nothing, and this leaves room for a loaded 2-core CI machine.
IDLE_CPU_BOUND = 0.10


def _cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (/proc/PID/stat's utime and stime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # past the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_share(pid: int, seconds: float) -> float:
    """The share of one core ``pid`` used over the next ``seconds``."""
    before = _cpu_seconds(pid)
    time.sleep(seconds)
    return (_cpu_seconds(pid) - before) / seconds


def test_two_ranks_rest_when_idle_and_answer_as_the_single_process_engine_does(serve):
    """The worker rests (blocked in the OS) while rank 0 has nothing to run, and the first request after
    that gets the one-process engine's greedy tokens."""
    client = _client(serve)
    _, rank1 = _ranks(serve)
    # Rank 0 lets the other ranks rest at its first housekeeping with nothing in flight (every 0.5 s).
    time.sleep(2)
    share = _cpu_share(rank1, 3)
    print(f"idle worker: {share:.1%} of a core over 3 s")
    assert share < IDLE_CPU_BOUND
    model = client.models.list().data[0].id
    engine = Engine(EngineConfig(num_kv_blocks=64, max_model_len=1024, max_num_seqs=4))
    tokenizer = AutoTokenizer.from_pretrained(engine.info.tokenizer_dir)
    prompt = tokenizer.encode(LONG_PROMPT)
    expected = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode(expected)
    # Twice: the second is served from both ranks' prefix caches.
    r2 = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == r.choices[0].text
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def _stream(client, model, record, started):
    try:
        for _ in client.completions.create(model=model, prompt=PROMPT, max_tokens=900, stream=True,
                                           extra_body={"ignore_eos": True}):
            record["chunks"] += 1
            if record["chunks"] >= 3:
                started.set()
    except Exception as e:  # the SDK raises on the stream's error event
        record["error"] = e
    finally:
        record["ended"] = time.monotonic()
        started.set()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_rank_that_dies_or_stops_ends_requests_with_an_error_and_all_ranks_restart(serve, how):
    client = _client(serve)
    model = client.models.list().data[0].id
    rank0, rank1 = _ranks(serve)
    record, started = {"chunks": 0, "error": None, "ended": None}, threading.Event()
    t = threading.Thread(target=_stream, args=(client, model, record, started), daemon=True)
    t.start()
    assert started.wait(120) and record["error"] is None, serve.log()[-3000:]
    hit = time.monotonic()
    os.kill(rank1, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    try:
        t.join(60)
        assert record["ended"] is not None, "the stream is still open:\n" + serve.log()[-3000:]
        # A dead rank breaks the link at once; a stopped one is given up after --pipeline-timeout 6.
        print(f"{how}: the stream ended {record['ended'] - hit:.1f}s after the rank was {how}")
        assert isinstance(record["error"], openai.APIError), record
        deadline = time.monotonic() + 30
        while not gone(rank0):
            assert time.monotonic() < deadline, "rank 0 did not exit:\n" + serve.log()[-3000:]
            time.sleep(0.2)
    finally:
        if how == "stopped":
            os.kill(rank1, signal.SIGKILL)
    # The supervisor starts the engine again, and the engine its other rank.
    serve.wait_healthy()
    new0, new1 = _ranks(serve)
    assert new0 != rank0 and new1 != rank1
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8)
    assert r.choices[0].text
