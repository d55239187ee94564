"""The KV disk cache across a restart of `mlxd serve`: the returning session's prompt is a cache hit."""

from __future__ import annotations

import os
import time

import openai

from tests.e2e.serve_harness import SMALL, Serve

# ~300 tokens of context: many 16-token blocks, within the small pool and context of SMALL.
CONTEXT = " ".join(f"Fact {i}: the crate number {i} holds {i * 7 % 13} red marbles." for i in range(18))
ASK = dict(messages=[{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Which crate is first?"}],
           max_tokens=8, temperature=0)


def _ask(serve: Serve):
    client = openai.OpenAI(base_url=serve.url + "/v1", api_key="x", max_retries=0, timeout=120)
    return client.chat.completions.create(model=client.models.list().data[0].id, **ASK)


def _block_files(root) -> list[str]:
    return [name for ns in os.scandir(root) if ns.is_dir() for name in os.listdir(ns.path) if len(name) == 32]


def test_a_restarted_server_serves_the_last_session_from_disk(tmp_path):
    flags = [*SMALL, "--kv-disk-cache", "--kv-cache-dir", str(tmp_path / "kv")]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first = Serve(tmp_path / "one", *flags).start().wait_healthy()
    try:
        before = _ask(first)
        assert before.usage.prompt_tokens > 200
        # The engine writes its cached blocks at its first idle moment after the request.
        deadline = time.monotonic() + 30
        while len(_block_files(tmp_path / "kv")) < before.usage.prompt_tokens // 16 - 1:
            assert time.monotonic() < deadline, first.log()[-3000:]
            time.sleep(0.2)
    finally:
        first.stop(graceful=True)  # the tier's queued writes finish
    second = Serve(tmp_path / "two", *flags).start().wait_healthy()
    try:
        after = _ask(second)
    finally:
        second.stop()
    cached = after.usage.prompt_tokens_details.cached_tokens
    assert cached == (after.usage.prompt_tokens - 1) // 16 * 16, second.log()[-3000:]
    assert after.choices[0].message.content == before.choices[0].message.content
