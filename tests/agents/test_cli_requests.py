"""The requests Codex CLI and Claude Code really send (captured by tests/agents/clis.py), replayed fast.

Fixtures: each CLI's first request and its follow-up carrying a tool call and
the tool's result, recorded by `python -m tests.agents.capture` from the runs
test_coding_clis.py makes (the first
request's tool_choice was forced on the wire so that SmolLM2 called a tool;
the recorded bodies are the CLI's own), plus Claude Code's first request with
its default tool set. Replayed through the gateway's translation and the real
SmolLM2 tokenizer's template, they show a regression without the CLIs.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mlxd.gateway import anthropic as A
from mlxd.gateway import responses as R
from mlxd.gateway.responses_tools import responses_tools

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture(scope="module")
def tokenizer():
    import mlx.core as mx

    from mlxd.engined.loaders import default_model_path
    from mlxd.engined.loaders.gguf_tokenizer import build_tokenizer_dir
    from mlxd.gateway.params import Tokenizer

    path = default_model_path()
    _, meta = mx.load(path, return_metadata=True)
    return Tokenizer(str(build_tokenizer_dir(meta, path)))


def codex(name: str):
    req = msgspec.json.decode(json.dumps(load(name)), type=R.ResponsesRequest)
    tools = responses_tools(req.tools)
    return req, tools, R.chat_input(req, tools)


def claude(name: str):
    req = msgspec.json.decode(json.dumps(load(name)), type=A.MessagesRequest)
    return req, A.chat_input(req)


def test_codex_first_request_flattens_namespaces_and_sets_hosted_tools_aside(tokenizer):
    body = load("codex_first.json")
    req, tools, inp = codex("codex_first.json")
    declared = [t for t in body["tools"] if t["type"] == "function"]
    namespaced = [(t["name"], ns["name"]) for ns in body["tools"] if ns["type"] == "namespace" for t in ns["tools"]]
    hosted = [t["type"] for t in body["tools"] if t["type"] not in ("function", "namespace")]
    assert namespaced and hosted == ["web_search"]
    flat = [t["function"]["name"] for t in inp.tools]
    assert flat == [t["name"] for t in declared[:4]] + [n for n, _ in namespaced] + [t["name"] for t in declared[4:]]
    for name, ns in namespaced:
        assert tools.client_name(name) == (name, ns) and tools.flat_name(name, ns) == name
    assert tools.client_name("exec_command") == ("exec_command", None)
    # Codex's developer turns are system instructions; the user's prompt comes last.
    assert [m["role"] for m in inp.messages] == ["system", "system", "user", "user"]
    prompt = body["input"][-1]["content"][0]["text"]
    assert inp.messages[-1]["content"] == prompt and inp.max_tokens is None and inp.tool_choice == "auto"
    text = tokenizer.render_chat(inp.messages, tools=inp.tools)
    assert prompt in text and "web_search" not in text


def test_codex_follow_up_carries_the_call_and_its_output_in_order():
    body = load("codex_tool_followup.json")
    _, _, inp = codex("codex_tool_followup.json")
    call = next(i for i in body["input"] if i["type"] == "function_call")
    out = next(i for i in body["input"] if i["type"] == "function_call_output")
    assert inp.messages[-2:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call["call_id"], "type": "function", "function": {"name": "get_goal", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": out["call_id"], "content": out["output"]}]


def test_a_namespaced_call_goes_back_under_its_namespace_and_returns_flat():
    body = load("codex_tool_followup.json")
    for item in body["input"]:
        if item["type"] == "function_call":
            item.update(name="spawn_agent", namespace="multi_agent_v1", arguments='{"message": "hi"}')
    req = msgspec.json.decode(json.dumps(body), type=R.ResponsesRequest)
    tools = responses_tools(req.tools)
    inp = R.chat_input(req, tools)
    assert inp.messages[-2]["tool_calls"][0]["function"] == {"name": "spawn_agent", "arguments": {"message": "hi"}}
    shell = R._Shell("resp_x", "m", req, tools)
    item = shell.call_item("fc_1", "call_1", "spawn_agent", '{"message": "hi"}', "completed")
    assert (item["name"], item["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert "namespace" not in shell.call_item("fc_2", "call_2", "exec_command", "{}", "completed")


@pytest.mark.parametrize("name", ["claude_code_first.json", "claude_code_default_first.json"])
def test_claude_code_first_request_folds_its_system_turns(name, tokenizer):
    body = load(name)
    req, inp = claude(name)
    inner = [m for m in body["messages"] if m["role"] == "system"]
    assert inner, "Claude Code sends system turns inside messages"
    system = inp.messages[0]
    assert system["role"] == "system" and [m["role"] for m in inp.messages[1:]] == ["user"]
    for block in body["system"] + [b for m in inner for b in m["content"]]:
        assert block["text"] in system["content"]
    assert [t["function"]["name"] for t in inp.tools] == [t["name"] for t in body["tools"]]
    assert inp.clamp_max_tokens and inp.max_tokens == body["max_tokens"]
    assert tokenizer.render_chat(inp.messages, tools=inp.tools).count("<|im_start|>system") == 1


def test_claude_code_follow_up_carries_tool_use_and_its_error_result():
    body = load("claude_code_tool_followup.json")
    _, inp = claude("claude_code_tool_followup.json")
    use = next(b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]
               if b["type"] == "tool_use")
    result = next(b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]
                  if b["type"] == "tool_result")
    assert inp.messages[-2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": use["id"], "type": "function", "function": {"name": "Read", "arguments": use["input"]}}]}
    assert inp.messages[-1] == {"role": "tool", "tool_call_id": use["id"], "content": result["content"]}
