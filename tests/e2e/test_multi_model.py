"""Several models behind one gateway (`mlxd serve` of a models file): each answers its own requests,
at once; /v1/models lists all; an unknown model is a 404 naming them; one engine's kill -9 leaves
the others serving; with --keep-alive an idle engine stops and its model comes back on the next
request with the same greedy answer."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest

from mlxd import cli
from mlxd.engined.loaders import default_model_path
from mlxd.model_set import nth_endpoint
from tests.e2e.serve_harness import Serve, gone
from tests.e2e.servers import Gateway, assert_error
from tests.e2e.test_embeddings import minilm_dir
from tests.tiny_models import fresh_seed, make_tiny_model

SMOL, TINY, MINILM = "smollm2", "tiny", "minilm"
POOL = ["--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--shutdown-timeout", "1"]


def models_file(tmp_path, tiny_dir, with_others: bool = True) -> str:
    tables = [f'[[models]]\nmodel = "{tiny_dir}"\nserved_model_name = "{TINY}"\nnum_kv_blocks = 32\n']
    if with_others:
        tables += [f'[[models]]\nmodel = "{default_model_path()}"\nserved_model_name = "{SMOL}"\nnum_kv_blocks = 48\n',
                   f'[[models]]\nmodel = "{minilm_dir()}"\nserved_model_name = "{MINILM}"\nmax_model_len = 256\n'
                   'num_kv_blocks = 32\n']
    path = tmp_path / "models.toml"
    path.write_text("\n".join(tables))
    return str(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", seed=fresh_seed("tiny chat model"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_dir):
    tmp = tmp_path_factory.mktemp("fleet")
    serve = Serve(tmp, *POOL, "--models-file", models_file(tmp, tiny_dir)).start()
    try:
        serve.wait_healthy(240)
        yield serve
    finally:
        serve.stop()


def engine_of(serve: Serve, model_dir) -> int:
    """The pid of the engine serving the model at ``model_dir``."""
    for pid in serve.engine_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if str(model_dir).encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no engine of {model_dir}:\n" + serve.log()[-4000:])


def greedy(client: openai.OpenAI, model: str) -> str:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=8, temperature=0).choices[0].message.content


def test_each_model_answers_its_own_requests_at_once(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [TINY, SMOL, MINILM]

    def chat(model):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=6, temperature=0)
        return r.model, r.choices[0].message.content

    def embed(_):
        r = client.embeddings.create(model=MINILM, input=["a cat", "a dog"])
        return r.model, len(r.data[0].embedding)

    jobs = [(chat, SMOL), (chat, TINY), (embed, None), (chat, SMOL), (chat, TINY), (embed, None)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: job[0](job[1]), jobs))
    assert [g[0] for g in got] == [SMOL, TINY, MINILM, SMOL, TINY, MINILM]
    assert got[2][1] == 384
    # Greedy: each model's answer the same both times, and the two chat models' differ.
    assert got[0] == got[3] and got[1] == got[4] and got[0][1] != got[1][1]
    # A chat model cannot embed, and the embedding model cannot chat: each request reached its own engine.
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=TINY, input=["a cat"])


def test_an_unknown_model_is_a_404_naming_the_models_served(fleet):
    r = httpx.post(fleet.url + "/v1/chat/completions", timeout=30,
                   json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    message = assert_error(r, anthropic=False, status=404)["message"]
    assert all(f"`{m}`" in message for m in (SMOL, TINY, MINILM)), message
    r = httpx.post(fleet.url + "/v1/messages", timeout=30,
                   json={"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert f"`{SMOL}`" in assert_error(r, anthropic=True, status=404)["message"]


def test_an_app_key_holds_for_every_model_of_a_second_gateway_on_the_same_engines(fleet, tmp_path, capsys):
    keys_file = str(tmp_path / "keys.json")
    assert cli.main(["keys", "add", "notes", "--keys-file", keys_file]) == 0
    key = capsys.readouterr().out.strip()
    # `mlxd gateway` given the set's endpoints, as serve gives its own gateway.
    endpoints = [f"{name}={nth_endpoint(fleet.endpoint, n)}" for n, name in enumerate((TINY, SMOL, MINILM))]
    gateway = Gateway(fleet.endpoint, str(tmp_path / "gateway.log"),
                      ["--keys-file", keys_file, "--model-endpoints", *endpoints]).start()
    try:
        gateway.wait_healthy(120)
        for model in (TINY, MINILM):
            r = httpx.post(gateway.url + "/v1/embeddings", json={"model": model, "input": "a cat"}, timeout=30)
            assert_error(r, anthropic=False, status=401)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=120)
        assert client.embeddings.create(model=MINILM, input=["a cat"]).model == MINILM
        assert greedy(client, TINY) == greedy(openai.OpenAI(base_url=fleet.url + "/v1", api_key="x",
                                                            max_retries=0, timeout=120), TINY)
    finally:
        gateway.stop()


def test_kill_9_of_one_engine_leaves_the_others_serving(fleet, tiny_dir):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=120)
    before = greedy(client, SMOL)
    pid = engine_of(fleet, tiny_dir)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not gone(pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Its own model's requests get a clear 503 until it is back ...
    r = httpx.post(fleet.url + "/v1/chat/completions", timeout=30,
                   json={"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert "engine" in assert_error(r, anthropic=False, status=503)["message"]
    # ... while the others answer as before.
    assert greedy(client, SMOL) == before
    assert client.embeddings.create(model=MINILM, input=["a cat"]).model == MINILM
    fleet.wait_healthy(120)
    assert greedy(client, TINY)


def test_an_idle_model_stops_after_keep_alive_and_comes_back_with_the_same_answer(tmp_path, tiny_dir):
    serve = Serve(tmp_path, *POOL, "--keep-alive", "2", "--models-file",
                  models_file(tmp_path, tiny_dir, with_others=False)).start()
    try:
        serve.wait_healthy(120)
        # Nothing is loaded yet, and the model is listed all the same.
        assert serve.engine_pids() == []
        assert httpx.get(serve.url + "/health", timeout=10).json()["models"][TINY]["status"] == "stopped"
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="x", max_retries=0, timeout=180)
        assert [m.id for m in client.models.list().data] == [TINY]
        first = greedy(client, TINY)  # waits for the engine to start
        pid = engine_of(serve, tiny_dir)
        deadline = time.monotonic() + 30
        while not gone(pid):
            assert time.monotonic() < deadline, "the idle engine was not stopped:\n" + serve.log()[-4000:]
            time.sleep(0.2)
        # The engine's lines carry its model's name (the engines of a set share serve's log).
        assert "idle for" in serve.log() and "[tiny]: " in serve.log()
        assert greedy(client, TINY) == first
        assert engine_of(serve, tiny_dir) != pid
    finally:
        serve.stop()
