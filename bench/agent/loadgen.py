"""Load over HTTP, streaming: closed loop (`concurrency` workers, each running whole sessions turn by
turn) or open loop (sessions arriving at Poisson times, `rate` a second, whatever is still running).

Per request it records TTFT (first chunk carrying content, reasoning or a
tool-call delta), the gaps between such chunks (inter-token latency, as
vLLM's `bench serve` defines it: per chunk), end-to-end latency, and the
token counts from the final `usage` chunk. Each request ends in exactly one
outcome: "ok" (text or a tool call, stream finished), "http_error" (refused,
non-200, or no connection), "dropped" (the stream broke or ended without a
finish), or "empty" (finished with no output).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from .workload import Request

OUTCOMES = ("ok", "http_error", "dropped", "empty")


@dataclass
class Result:
    session: int
    turn: int
    outcome: str
    start: float  # seconds on the run's clock (time.perf_counter)
    end: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # of the prompt's, served from the server's cache (None: its usage says not)
    output_tokens: int = 0
    tool_call: bool = False
    detail: str = ""

    @property
    def e2e(self) -> float:
        return self.end - self.start


async def _one(client: httpx.AsyncClient, url: str, model: str, req: Request) -> Result:
    t0 = time.perf_counter()
    r = Result(req.session, req.turn, "dropped", t0, t0)
    text, chunks, last, finished = [], 0, None, False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=req.body(model)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread())[:200].decode(errors="replace")
                r.outcome, r.detail = "http_error", f"{resp.status_code} {body}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    r.prompt_tokens = msg["usage"].get("prompt_tokens") or 0
                    r.cached_tokens = (msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                    r.output_tokens = msg["usage"].get("completion_tokens") or 0
                for choice in msg.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "") \
                        + (delta.get("reasoning") or "")
                    if delta.get("tool_calls"):
                        r.tool_call = True
                    if piece or delta.get("tool_calls"):
                        now = time.perf_counter()
                        if last is None:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
                        chunks += 1
                        text.append(piece)
                    if choice.get("finish_reason"):
                        finished = True
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        r.outcome, r.detail = "http_error", f"{type(e).__name__}: {e}"
        r.end = time.perf_counter()
        return r
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.detail = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    out = "".join(text)
    # The agent's system prompt asks for calls as text; a parser on the server may return them as deltas.
    r.tool_call = r.tool_call or "<tool_call>" in out
    if not r.output_tokens:
        r.output_tokens = chunks  # a server without include_usage: one token per chunk, a lower bound
    if r.detail:
        return r  # dropped mid-stream
    if not finished:
        r.detail = "stream ended without a finish_reason or [DONE]"
    elif not out.strip() and not r.tool_call:
        r.outcome = "empty"
    else:
        r.outcome = "ok"
    return r


async def run_closed_loop(url: str, model: str, sessions: list[list[Request]], concurrency: int,
                          timeout: float = 600.0) -> tuple[list[Result], float]:
    """Run all sessions with `concurrency` workers; returns the results and the wall time.

    A worker takes the next session and sends its turns one after another,
    each as soon as the previous one ends (closed loop), as an agent does.
    """
    queue: asyncio.Queue = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        async def worker():
            while not queue.empty():
                for req in queue.get_nowait():
                    results.append(await _one(client, url, model, req))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Start times (seconds from the run's start) of ``n`` sessions arriving as a Poisson process."""
    import numpy as np

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


async def run_open_loop(url: str, model: str, sessions: list[list[Request]], rate: float, seed: int = 0,
                        timeout: float = 600.0) -> tuple[list[Result], float]:
    """Start session i at ``arrival_times(...)[i]`` whether or not earlier ones have ended (open loop, as
    vLLM's `bench serve --request-rate`); a session's turns still follow one another. Returns the
    results and the wall time from the first arrival to the last end."""
    starts = arrival_times(len(sessions), rate, seed)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def session(start: float, turns: list[Request]):
            await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
            for req in turns:
                results.append(await _one(client, url, model, req))

        await asyncio.gather(*(session(t, s) for t, s in zip(starts, sessions)))
        wall = time.perf_counter() - t0
    return results, wall


def run(url: str, model: str, sessions: list[list[Request]], concurrency: int,
        timeout: float = 600.0, rate: float | None = None, seed: int = 0) -> tuple[list[Result], float]:
    """Closed loop at ``concurrency``, or open loop at ``rate`` sessions a second when one is given."""
    if rate is not None:
        return asyncio.run(run_open_loop(url, model, sessions, rate, seed, timeout))
    return asyncio.run(run_closed_loop(url, model, sessions, concurrency, timeout))
