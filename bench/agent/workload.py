"""Request sets for the sweep: an agent split (multi-turn tool-using sessions) and a chat split.

Everything is scripted from a seed, so every server sees byte-identical
requests: the history of an agent session is written here, not taken from
the model's own replies (replies differ between servers and would make the
prompts differ too). Every prompt opens with the seed's project number, so
request sets of two seeds share no prefix a server could have cached. Sizes
are in approximate tokens (~4 characters each for this kind of English/JSON
text); the servers' `usage` gives the real counts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": props, "required": list(props)}}}
    for name, desc, props in [
        ("read_file", "Read a file of the repository and return its text.",
         {"path": {"type": "string", "description": "path relative to the repository root"}}),
        ("search_code", "Search the repository for a regular expression; returns matching lines.",
         {"pattern": {"type": "string"}, "glob": {"type": "string", "description": "file glob filter"}}),
        ("run_tests", "Run the test suite or a subset and return the report.",
         {"selector": {"type": "string", "description": "pytest node id or keyword"}}),
        ("edit_file", "Replace an exact snippet of a file with new text.",
         {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}}),
        ("list_dir", "List the entries of a directory.", {"path": {"type": "string"}}),
        ("http_get", "Fetch a URL and return the body as text.", {"url": {"type": "string"}}),
    ]
]

# The system prompt is shared by all sessions of a seed: a server with a prefix cache may reuse it.
SYSTEM_AGENT = (
    "You are a coding agent working in a software repository. Think briefly, then either call "
    "exactly one tool or give the final answer. To call a tool, reply with "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> and nothing else.\n"
    "Available tools:\n" + "\n".join(json.dumps(t["function"]) for t in TOOLS)
)

_WORDS = ("request engine gateway block cache token stream batch prefill decode schedule queue "
          "memory kernel attention model layer weight tensor config handler socket frame error "
          "latency metric sample logits grammar parser template session history result value").split()
_IDENTS = ("run_step alloc_blocks free_blocks add_request abort_request make_batch write_slots "
           "read_frame send_outputs parse_tool_call apply_template count_tokens").split()


def _code_like(rng: random.Random, tokens: int) -> str:
    """Source-ish text of about `tokens` tokens: what read_file and search_code return."""
    lines, size = [], 0
    while size < tokens * CHARS_PER_TOKEN:
        ident = rng.choice(_IDENTS)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 10)))
        line = rng.choice([
            f"def {ident}(self, {rng.choice(_WORDS)}: int) -> None:  # {words}",
            f"    {rng.choice(_WORDS)}_{rng.randint(0, 99)} = self.{ident}({rng.choice(_WORDS)})",
            f"    # {words}",
            f"    if {rng.choice(_WORDS)} is None: raise ValueError('{words}')",
        ])
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def _project(seed: int) -> str:
    """What opens every prompt of a seed's requests (the first tokens after a chat template's own)."""
    return f"Project {seed}. "


def _prose(rng: random.Random, tokens: int) -> str:
    n = max(1, int(tokens * CHARS_PER_TOKEN / 7))
    return " ".join(rng.choice(_WORDS) for _ in range(n))


@dataclass
class Request:
    """One chat completion: messages, max_tokens, and which session/turn it belongs to."""
    session: int
    turn: int
    messages: list[dict]
    max_tokens: int
    approx_input_tokens: int = 0
    tools: list[dict] = field(default_factory=list)

    def body(self, model: str) -> dict:
        return {"model": model, "messages": self.messages, "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def agent_sessions(n_requests: int, scale: float, seed: int, turns: int = 4) -> list[list[Request]]:
    """Sessions of `turns` requests each (the last one may be shorter), `n_requests` in all.

    Turn k's prompt is the whole history so far; its size grows from ~1K to
    ~5K tokens (times `scale`) over the session, by tool results appended
    between turns. Each turn asks for 20-200 output tokens.
    """
    rng = random.Random(seed)
    sessions, made, sid = [], 0, 0
    while made < n_requests:
        task = _prose(rng, 60)
        system = _project(seed) + SYSTEM_AGENT
        history = [{"role": "system", "content": system},
                   {"role": "user", "content": f"Task {sid}: fix the failing test. Notes: {task}"}]
        size = (len(system) + len(task)) // CHARS_PER_TOKEN
        session = []
        k_turns = min(turns, n_requests - made)
        for k in range(k_turns):
            target = int(scale * (1000 + 4000 * k / max(1, turns - 1)) * rng.uniform(0.9, 1.1))
            if k > 0 or target > size:
                # The previous step of the scripted agent: a tool call and its (large) result.
                tool = rng.choice(TOOLS)["function"]["name"]
                args = {"path": f"src/{rng.choice(_IDENTS)}.py"}
                call_id = f"call_{sid}_{k}"
                # The call is written as text in the content, in the format the system prompt
                # asks for: structured `tool_calls` in history are rendered (or dropped) differently
                # by each server's template, and the prompts must be the same everywhere.
                call = json.dumps({"name": tool, "arguments": args})
                history.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
                grow = max(50, target - size)
                history.append({"role": "tool", "tool_call_id": call_id, "content": _code_like(rng, grow)})
                size += grow + 20
            session.append(Request(sid, k, [dict(m) for m in history], rng.randint(20, 200), size))
        sessions.append(session)
        made += k_turns
        sid += 1
    return sessions


def chat_sessions(n_requests: int, scale: float, seed: int) -> list[list[Request]]:
    """Single-turn chats: a short system prompt and a question of ~100-500 tokens (times `scale`)."""
    rng = random.Random(seed + 1)
    out = []
    for i in range(n_requests):
        q = _prose(rng, int(scale * rng.randint(100, 500)))
        msgs = [{"role": "system", "content": _project(seed) + "You are a helpful assistant."},
                {"role": "user", "content": f"Summarize these notes in a few sentences: {q}"}]
        out.append([Request(i, 0, msgs, rng.randint(20, 200), len(q) // CHARS_PER_TOKEN)])
    return out


def make(split: str, n_requests: int, scale: float, seed: int, turns: int = 4) -> list[list[Request]]:
    if split == "agent":
        return agent_sessions(n_requests, scale, seed, turns)
    if split == "chat":
        return chat_sessions(n_requests, scale, seed)
    raise ValueError(f"unknown split {split!r}: agent or chat")
