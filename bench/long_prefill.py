"""Decode streams beside a long prefill: the largest gap between a stream's tokens while it runs.

``mlxd engine`` and ``mlxd gateway`` run as real processes (the embedded
SmolLM2 unless ``--model``, ``--max-model-len 8192``). ``--streams`` greedy
streams start; once each has its first tokens, one non-streamed completion of
a ``--long``-token prompt is sent. The report gives, over the window from that
request's send to its answer, each stream's largest gap between two SSE token
events, the long request's own latency, and the engine's steps over the
window (count and mean duration, from ``/health?fresh=1``). ``--code DIR`` runs
engine and gateway from another source tree (an older commit, for a before/after).

    python -m bench.long_prefill [--long 6500] [--streams 3] [--code DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

from mlxd.bench.serving import wait_healthy

_WORDS = ("river stone lamp orbit quiet violet harbor maple signal copper meadow lantern falcon "
          "ember tide glass thunder willow cobalt saffron").split()


def _prompt(url: str, rng: np.random.Generator, n_tokens: int) -> list[int]:
    text = " ".join(rng.choice(_WORDS, size=n_tokens))
    return httpx.post(url + "/tokenize", json={"prompt": text}, timeout=120).json()["tokens"][:n_tokens]


async def _stream(http, url, prompt, max_tokens, times: list[float], started: asyncio.Event):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                if len(times) >= 8:
                    started.set()


async def _measure(url: str, streams: list[list[int]], long: list[int]) -> dict:
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=16)) as http:
        times = [[] for _ in streams]
        events = [asyncio.Event() for _ in streams]
        tasks = [asyncio.create_task(_stream(http, url, p, 4000, t, e)) for p, t, e in zip(streams, times, events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 300)
        before = (await http.get(url + "/health?fresh=1")).json()["engine"]
        t0 = time.monotonic()
        r = await http.post(url + "/v1/completions", json={"prompt": long, "max_tokens": 1, "temperature": 0})
        t1 = time.monotonic()
        r.raise_for_status()
        after = (await http.get(url + "/health?fresh=1")).json()["engine"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps = []
    for ts in times:
        inside = [t for t in ts if t0 <= t <= t1]
        # The gap from the send to the first token inside the window counts too.
        points = [max(t for t in ts if t < t0)] + inside if any(t < t0 for t in ts) else inside
        gaps.append(max((b - a for a, b in zip(points, points[1:])), default=t1 - t0))
    steps = after["num_steps"] - before["num_steps"]
    return {"long_latency_s": t1 - t0, "largest_gap_s": max(gaps), "gaps_s": gaps, "engine_steps": steps,
            "mean_step_s": (after["step_seconds"] - before["step_seconds"]) / max(steps, 1),
            "tokens_during": [sum(t0 <= t <= t1 for t in ts) for ts in times]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=6500)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--port", type=int, default=18437)
    ap.add_argument("--model", default="")
    ap.add_argument("--code", default=None, help="source tree the engine and gateway run from")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"seed {args.seed}")
    rng = np.random.default_rng(args.seed)
    env = dict(os.environ)
    if args.code:
        env["PYTHONPATH"] = args.code
    model = ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/engine.sock"
        engine = subprocess.Popen([sys.executable, "-m", "mlxd", "engine", "--engine-endpoint", endpoint,
                                   "--log-level", "WARNING", "--max-model-len", "8192",
                                   "--kv-cache-memory", "400000000", "--max-num-seqs", "8", *model], env=env,
                                  # ``-m`` puts the working directory first on the path, ahead of PYTHONPATH.
                                  cwd=args.code)
        gateway = subprocess.Popen([sys.executable, "-m", "mlxd", "gateway", "--log-level", "WARNING",
                                    "--engine-endpoint", endpoint, "--port", str(args.port)], env=env, cwd=args.code)
        url = f"http://127.0.0.1:{args.port}"
        try:
            wait_healthy(url, engine, gateway)
            streams = [_prompt(url, rng, 40) for _ in range(args.streams)]
            long = _prompt(url, rng, args.long)
            result = asyncio.run(_measure(url, streams, long))
            result.update(long_tokens=len(long), streams=args.streams, code=args.code or "this tree")
            print(json.dumps(result))
        finally:
            for proc in (gateway, engine):
                proc.terminate()
            for proc in (gateway, engine):
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
