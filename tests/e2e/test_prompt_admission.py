"""Every prompt of a completions request is one engine request and counts against the waiting queue.

A request with more prompts than the queue holds is refused whole (429), the
prompts already queued are withdrawn, and requests beside it are served as
if it had never come.
"""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest

from tests.e2e.servers import Engine, Gateway, free_port


@pytest.fixture(scope="module")
def queue_of_four(tmp_path_factory):
    logs = tmp_path_factory.mktemp("prompt-admission")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = Engine(endpoint, str(logs / "engine.log"),
                    extra=["--max-num-seqs", "1", "--max-waiting-requests", "4"]).start()
    gateway = Gateway(endpoint, str(logs / "gateway.log")).start()
    gateway.wait_healthy()
    yield gateway
    gateway.stop()
    engine.stop()


def _queues(gateway) -> tuple[int, int]:
    e = gateway.health(fresh=True).json()["engine"]
    return e["num_running"], e["num_waiting"]


def test_a_request_with_more_prompts_than_the_queue_holds_is_refused_whole(queue_of_four):
    gateway = queue_of_four
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def small(i):
        r = client.completions.create(model=model, prompt=f"Count to {i}:", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    with cf.ThreadPoolExecutor(2) as pool:
        beside = pool.submit(small, 1)
        # Eight prompts: one runs, four wait, the rest are refused by the engine, so the whole request is.
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=model, prompt=[f"Say {i}:" for i in range(8)], max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert refused.value.body["code"] == "overloaded" and "--max-waiting-requests 4" in refused.value.body[
            "message"]
        assert beside.result() == 16
    # Nothing of the refused request is left running or queued.
    assert _queues(gateway) == (0, 0)
    # Three prompts fit (one running, two waiting): all are answered, each in full.
    r = client.completions.create(model=model, prompt=[f"Say {i}:" for i in range(3)], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 24
    assert _queues(gateway) == (0, 0)
