"""Hostile requests on every route of a real `mlxd serve`: a seeded generator, a checker, and figures.

Each case starts from a small valid request of one route (chat completions,
completions, messages, count_tokens, responses, tokenize, detokenize,
models) and breaks it: a field set to a value past its range or of another
type, JSON nested too deep, a field dropped or added, a body cut short or not
JSON at all, a foreign Host or Origin, a body not declared JSON. Generation
requests keep max_tokens at most 4 and n at most 2 wherever they are valid,
so that the few a server accepts stay cheap. A case is a pure function of
(seed, index): ``--seed S --only I`` replays one.

Every answer must be below 500 and, when an error, in the route's error
shape (Anthropic's on /v1/messages*, OpenAI's elsewhere); a stream must not
carry an internal error. The engine process must be the same one at the end
and a normal request must be answered.

    python -m bench.fuzz [--requests 20000] [--seed 0] [--concurrency 8] [--out bench/fuzz_results.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}

# route name -> (method, path, a valid body)
ROUTES: dict[str, tuple[str, str, dict | None]] = {
    "chat": ("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "temperature": 0}),
    "completions": ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0}),
    "messages": ("POST", "/v1/messages", {"messages": USER, "max_tokens": 2, "temperature": 0}),
    "count_tokens": ("POST", "/v1/messages/count_tokens", {"messages": USER}),
    "responses": ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "temperature": 0}),
    "tokenize": ("POST", "/tokenize", {"prompt": "hi"}),
    "detokenize": ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    "models": ("GET", "/v1/models", None),
}
# Fields a route may be given, beyond its valid body, each a value that is valid and cheap.
EXTRA_FIELDS = {
    "chat": {"top_k": 5, "top_p": 0.9, "seed": 1, "n": 2, "stop": ["x"], "logprobs": True, "top_logprobs": 2,
             "priority": 1, "min_p": 0.1, "presence_penalty": 0.5, "logit_bias": {"1": 2}, "stream": True,
             "tools": [TOOL], "tool_choice": "none", "response_format": {"type": "text"},
             "stop_token_ids": [2], "min_tokens": 1, "repetition_penalty": 1.1, "cache_salt": "s",
             "chat_template_kwargs": {"x": 1}, "continue_final_message": False, "ignore_eos": True,
             "stream_options": {"include_usage": True}, "structured_outputs": {"choice": ["a", "b"]},
             "messages": USER + [{"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "2"}]},
    "completions": {"top_k": 5, "seed": 1, "n": 2, "logprobs": 2, "echo": True, "stream": True, "priority": 1,
                    "stop": "x", "frequency_penalty": 0.5, "best_of": 2, "suffix": "", "ignore_eos": True},
    "messages": {"top_k": 5, "top_p": 0.9, "stop_sequences": ["x"], "system": "be brief", "stream": True,
                 "tools": [{"name": "add", "input_schema": TOOL["function"]["parameters"]}],
                 "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"},
                 "messages": USER + [{"role": "assistant", "content": [
                     {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]}]},
    "count_tokens": {"system": "be brief", "tools": [{"name": "add", "input_schema": {"type": "object"}}]},
    "responses": {"top_p": 0.9, "top_k": 5, "instructions": "be brief", "stream": True, "store": False,
                  "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
                  "input": [{"role": "user", "content": "hi"},
                            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
                            {"type": "function_call_output", "call_id": "c1", "output": "2"}]},
    "tokenize": {"add_special_tokens": False},
    "detokenize": {},
    "models": {},
}

_BIG = [1 << 31, 1 << 63, (1 << 63) - 1, (1 << 64) - 1, 1 << 64, 1 << 70, 10 ** 40, -(1 << 63) - 1, -(1 << 70)]
_SMALL_BAD = [-2, -1, 0, 65, 100000]
_FLOATS = [1e308, -1e308, 1e-320, -0.0, 2.5, 101.0, -3.0]
_STRINGS = ["", " ", "\u0000", "\ud7ff\ue000", "a" * 5000, "<|im_start|>system", "{{ 7*7 }}", "\x1b[31m",
            "null", "1e999", "\\u0000", "🦙" * 50]


def _deep(rng: random.Random) -> object:
    depth = rng.choice([65, 200, 999, 1001, 3000])
    value: object = rng.choice([1, "x", None])
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def _hostile_value(rng: random.Random) -> object:
    kind = rng.randrange(9)
    if kind == 0:
        return rng.choice(_BIG)
    if kind == 1:
        return rng.choice(_SMALL_BAD)
    if kind == 2:
        return rng.choice(_FLOATS)
    if kind == 3:
        if rng.random() < 0.3:  # JSON text nested deep, for fields that hold JSON in a string
            d = rng.choice([65, 1000, 5000])
            return rng.choice(["[" * d + "]" * d, '{"a":' * d + "1" + "}" * d])
        return rng.choice(_STRINGS)
    if kind == 4:
        return rng.choice([None, True, False, [], {}, [None], {"": None}])
    if kind == 5:
        return _deep(rng)
    if kind == 6:
        return [rng.choice(_BIG + _SMALL_BAD) for _ in range(rng.choice([1, 3, 50]))]
    if kind == 7:
        return {str(rng.choice(_BIG)): rng.choice(_FLOATS), "x": 1}
    return [{"role": rng.choice(["user", "wizard", "tool", "", None, 5]), "content": rng.choice(
        ["hi", 5, None, [{"type": "text", "text": 5}], [{"type": "image", "source": {}}], [{"type": "tool_result",
                                                                                           "content": 5}]])}]


def _paths(value, prefix=()) -> list[tuple]:
    """Every key path into a body (dict keys and list indices), so a nested field can be broken too."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def _set(body, path: tuple, value) -> None:
    for k in path[:-1]:
        body = body[k]
    body[path[-1]] = value


def _delete(body, path: tuple) -> None:
    for k in path[:-1]:
        body = body[k]
    del body[path[-1]]


# Fields whose removal makes a valid request expensive (a whole context's worth of tokens).
_KEEP = {"max_tokens", "max_output_tokens"}


@dataclass
class Case:
    index: int
    route: str
    method: str
    path: str
    headers: dict[str, str]
    content: bytes
    mutation: str

    @property
    def anthropic(self) -> bool:
        return self.path.startswith("/v1/messages")


def make_case(seed: int, index: int) -> Case:
    """Case ``index`` of the run seeded ``seed``; the same pair always gives the same case."""
    rng = random.Random(f"{seed}:{index}")
    route = rng.choice(list(ROUTES))
    method, path, base = ROUTES[route]
    body = json.loads(json.dumps(base)) if base is not None else None
    headers = {"content-type": "application/json"}
    extras = EXTRA_FIELDS[route]
    if body is not None:
        for k in rng.sample(sorted(extras), min(len(extras), rng.choice([0, 1, 2, 4]))):
            body[k] = json.loads(json.dumps(extras[k]))
    kind = rng.randrange(12) if body is not None else rng.choice([8, 9, 10, 11])
    mutation = ""
    content = b"" if body is None else json.dumps(body).encode()
    if kind <= 3:  # a field, maybe a nested one, gets a hostile value
        paths = _paths(body) + [(k,) for k in extras]
        p = rng.choice(paths)
        _set(body, p, _hostile_value(rng))
        mutation = f"set {'.'.join(map(str, p))}"
    elif kind == 4:  # a field dropped
        paths = [p for p in _paths(body) if p[-1] not in _KEEP]
        if paths:
            p = rng.choice(paths)
            _delete(body, p)
            mutation = f"drop {'.'.join(map(str, p))}"
    elif kind == 5:  # an unknown field, maybe deep
        body[rng.choice(["x", "__proto__", "messages_", "top_k "])] = _hostile_value(rng)
        mutation = "add field"
    elif kind == 6:  # the body nested in something
        body = rng.choice([[body], _deep(rng), "body", 5, None])
        mutation = "wrap body"
    if kind <= 6:
        try:
            content = json.dumps(body, allow_nan=True).encode()
        except RecursionError:  # Python's own json gives up first: send it hand-nested
            content = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    elif kind == 7:  # raw bytes that are not the JSON they claim
        content = rng.choice([content[:rng.randrange(max(1, len(content)))], b"\xff\xfe\x00", b"", b"   ",
                              b'{"a": NaN}', b'{"max_tokens": 1e999}', b"[" * 20000, b'{"a": "\\ud800"}',
                              content + b"garbage", b'{"messages": [}'])
        mutation = "raw body"
    elif kind == 8:
        headers["host"] = rng.choice(["evil.example", "127.0.0.1.evil.example", "localhost.evil", "[::1"])
        mutation = "host"
    elif kind == 9:
        headers["origin"] = rng.choice(["https://evil.example", "null", "http://127.0.0.1:1"])
        mutation = "origin"
    elif kind == 10:
        if method == "POST":
            headers["content-type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", "",
                                                  "application/jsonx", "multipart/form-data"])
        else:
            method = "POST"
        mutation = "content-type/method"
    else:
        method = rng.choice(["GET", "PUT", "DELETE", "POST"] if method == "POST" else ["POST", "DELETE"])
        mutation = "method"
    return Case(index, route, method, path, headers, content, mutation)


def problem(case: Case, status: int, content_type: str, body: bytes) -> str | None:
    """What is wrong with an answer, or None."""
    if status >= 500:
        return f"status {status}: {body[:300]!r}"
    if status == 200 and content_type.startswith("text/event-stream"):
        if b"internal_error" in body or b'"api_error"' in body:
            return f"internal error inside a stream: {body[-300:]!r}"
        return None
    if status < 400:
        try:
            json.loads(body)
        except ValueError:
            return f"status {status} with a body that is not JSON: {body[:200]!r}"
        return None
    try:
        err = json.loads(body)
    except ValueError:
        return f"status {status} with a body that is not JSON: {body[:200]!r}"
    if case.anthropic:
        ok = (isinstance(err, dict) and err.get("type") == "error" and isinstance(err.get("error"), dict)
              and set(err["error"]) == {"type", "message"})
    else:
        ok = (isinstance(err, dict) and isinstance(err.get("error"), dict)
              and set(err["error"]) == {"message", "type", "param", "code"} and bool(err["error"]["message"]))
    return None if ok else f"status {status} with a body not in the route's error shape: {body[:300]!r}"


@dataclass
class Report:
    statuses: Counter = field(default_factory=Counter)
    by_route: Counter = field(default_factory=Counter)
    problems: list[tuple[int, str, str]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    # (seconds, case index, route, mutation, status) of every case
    timings: list[tuple[float, int, str, str, int]] = field(default_factory=list)
    wall: float = 0.0


async def send_all(url: str, cases: list[Case], concurrency: int = 8, timeout: float = 120.0) -> Report:
    report = Report()
    queue: asyncio.Queue = asyncio.Queue()
    for c in cases:
        queue.put_nowait(c)

    async def worker(client: httpx.AsyncClient):
        while not queue.empty():
            case = queue.get_nowait()
            t0 = time.perf_counter()
            try:
                r = await client.request(case.method, case.path, content=case.content, headers=case.headers)
                status, ctype, body = r.status_code, r.headers.get("content-type", ""), r.content
            except httpx.HTTPError as e:
                status, ctype, body = 599, "", f"{type(e).__name__}: {e}".encode()
            report.seconds.append(time.perf_counter() - t0)
            report.timings.append((report.seconds[-1], case.index, case.route, case.mutation, status))
            report.statuses[status] += 1
            report.by_route[case.route] += 1
            p = problem(case, status, ctype, body)
            if p is not None:
                report.problems.append((case.index, case.mutation, p))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    report.wall = time.perf_counter() - t0
    return report


def greedy_answer(url: str) -> str | None:
    """A plain greedy chat's answer, or None when it is not a 200 with text: asked before the run
    and after it, the two must be equal (hostile requests must not disturb what a normal one gets)."""
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0})
    return (r.json()["choices"][0]["message"]["content"] or None) if r.status_code == 200 else None


def _markdown(seed: int, n: int, report: Report, pid_same: bool, normal_ok: bool, concurrency: int) -> str:
    q = statistics.quantiles(report.seconds, n=100)
    statuses = ", ".join(f"{s}: {c}" for s, c in sorted(report.statuses.items()))
    routes = ", ".join(f"{r}: {c}" for r, c in sorted(report.by_route.items()))
    lines = [
        "# Fuzzing every route of `mlxd serve` with hostile requests",
        "",
        f"`python -m bench.fuzz --requests {n} --seed {seed} --concurrency {concurrency}`, against the embedded "
        "SmolLM2 on MLX's CPU backend (64 KV blocks, max_model_len 512), on this project's 2-core CI machine.",
        "",
        "| figure | value |", "|---|---|",
        f"| requests | {n} |",
        f"| wall time | {report.wall:.1f} s ({n / report.wall:.0f} requests/s) |",
        f"| latency p50 / p99 / max | {q[49] * 1000:.1f} / {q[98] * 1000:.1f} / {max(report.seconds) * 1000:.0f} ms |",
        f"| 5xx answers | {sum(c for s, c in report.statuses.items() if s >= 500)} |",
        f"| answers outside the route's error shape or with an internal error | {len(report.problems)} |",
        f"| engine process unchanged | {'yes' if pid_same else 'NO'} |",
        f"| the same greedy answer before and after | {'yes' if normal_ok else 'NO'} |",
        "",
        f"Statuses: {statuses}.", "",
        f"Requests per route: {routes}.", "",
    ]
    lines.append("Slowest cases (seconds, case, route, mutation, status; replay with `--only CASE`):")
    lines.append("")
    for sec, index, route, mutation, status in sorted(report.timings, reverse=True)[:5]:
        lines.append(f"- {sec:.1f} s: case {index}, {route}, {mutation or 'valid'}, {status}")
    lines.append("")
    for index, mutation, p in report.problems[:20]:
        lines.append(f"- case {index} ({mutation}): {p}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--only", type=int, default=None, help="replay one case: print it and its answer")
    ap.add_argument("--out", default="bench/fuzz_results.md")
    args = ap.parse_args(argv)
    from tests.e2e.serve_harness import SMALL, Serve

    serve = Serve(Path(tempfile.mkdtemp(prefix="mlxd-fuzz-")), *SMALL).start().wait_healthy()
    try:
        pid = serve.engine_pid()
        if args.only is not None:
            case = make_case(args.seed, args.only)
            print(case)
            r = httpx.request(case.method, serve.url + case.path, content=case.content, headers=case.headers)
            print(r.status_code, r.text[:2000])
            return 0
        cases = [make_case(args.seed, i) for i in range(args.requests)]
        before = greedy_answer(serve.url)
        report = asyncio.run(send_all(serve.url, cases, args.concurrency))
        pid_same = serve.engine_pid() == pid
        normal_ok = before is not None and greedy_answer(serve.url) == before
    finally:
        serve.stop()
    text = _markdown(args.seed, args.requests, report, pid_same, normal_ok, args.concurrency)
    Path(args.out).write_text(text)
    print(text)
    return 0 if pid_same and normal_ok and not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())
