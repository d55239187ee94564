"""Codex CLI and Claude Code, the real ones from npm, complete a tool round trip against `mlxd serve`.

One `mlxd serve` on loopback (the embedded SmolLM2, a small KV pool, a
context that holds the CLIs' prompts, and the operator's output cap that
agents need: they send no limit or one far past the context). Each CLI runs
once, non-interactively; the recorder between it and the gateway must see
every answer 2xx, the CLI's own tool definitions accepted, and a follow-up
request carrying the tool call and its result in the CLI's own format.
"""

from __future__ import annotations

import json

import pytest

from tests.agents import clis


@pytest.fixture(scope="module", autouse=True)
def _clis_installed():
    # .ci/run installs them; a missing CLI is a failure, never a skip.
    missing = clis.installed()
    assert missing is None, f"needs the CLIs ({missing}): run the npm install line of .ci/run"

CAP = clis.CAP


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with clis.serve(tmp_path_factory.mktemp("serve")) as url_model:
        yield url_model


def _report(run: clis.Run) -> str:
    lines = [f"rc={run.returncode}", "stdout: " + run.stdout[-2000:], "stderr: " + run.stderr[-3000:]]
    lines += [f"{e.method} {e.path} -> {e.status}: {e.response[:300]!r}" for e in run.exchanges]
    return "\n".join(lines)


def _sse_events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


def test_codex_exec_calls_a_tool_and_finishes(served, tmp_path):
    run = clis.codex_round_trip(*served, tmp_path)
    report = _report(run)
    assert run.returncode == 0, report
    assert run.exchanges and all(200 <= e.status < 300 for e in run.exchanges), report
    posts = [e for e in run.posts if e.path.startswith("/v1/responses")]
    assert len(posts) >= 2, report
    first = posts[0].body
    # What mlxd refused before: namespaced function tools and hosted ones, in Codex's first request.
    kinds = {t["type"] for t in first["tools"]}
    assert {"function", "namespace"} <= kinds and kinds - {"function", "namespace"}, kinds
    events = _sse_events(posts[0].response)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    calls = [i for i in done if i["type"] == "function_call"]
    assert calls and calls[0]["name"] == "get_goal" and calls[0]["status"] == "completed", report
    follow = posts[1].body["input"]
    sent = [i for i in follow if i.get("type") == "function_call"]
    results = [i for i in follow if i.get("type") == "function_call_output"]
    assert [c["call_id"] for c in sent] == [calls[0]["call_id"]], follow[-3:]
    assert [r["call_id"] for r in results] == [calls[0]["call_id"]], follow[-3:]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    # Codex sends no output limit: the operator's cap holds every answer.
    for e in posts:
        assert 0 < _sse_events(e.response)[-1]["response"]["usage"]["output_tokens"] <= CAP


def test_claude_print_calls_a_tool_and_finishes(served, tmp_path):
    run = clis.claude_round_trip(*served, tmp_path)
    report = _report(run)
    assert run.returncode == 0, report
    assert run.exchanges and all(200 <= e.status < 300 for e in run.exchanges), report
    posts = [e for e in run.posts if e.path.startswith("/v1/messages")]
    assert len(posts) >= 2, report
    first = posts[0].body
    # What mlxd refused before: system turns inside messages; and a max_tokens past the context.
    assert any(m["role"] == "system" for m in first["messages"]), [m["role"] for m in first["messages"]]
    assert first["max_tokens"] > clis.CONTEXT
    events = _sse_events(posts[0].response)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    uses = [e["content_block"] for e in events if e["type"] == "content_block_start"
            and e["content_block"]["type"] == "tool_use"]
    assert uses and uses[0]["name"] == "Read", report
    follow = posts[1].body["messages"]
    blocks = [b for m in follow if isinstance(m["content"], list) for b in m["content"]]
    assert [b["id"] for b in blocks if b["type"] == "tool_use"] == [uses[0]["id"]]
    assert [b["tool_use_id"] for b in blocks if b["type"] == "tool_result"] == [uses[0]["id"]]
    for e in posts:  # 32000 asked for, clamped to the context, capped by the operator
        end = next(x for x in _sse_events(e.response) if x["type"] == "message_delta")
        assert 0 < end["usage"]["output_tokens"] <= CAP
