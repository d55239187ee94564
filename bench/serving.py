"""Serving overhead: 16 streams through gateway + wire against the in-process Engine.

Both sides run the same engine settings, the same token-id prompts, greedy
decoding and ``ignore_eos`` (every request generates exactly ``--max-tokens``).
In-process: ``Engine.add_request`` for all, then ``step()`` until done.
Served: ``mlxd engine`` and ``mlxd gateway`` as real processes, the requests
sent at once as streamed /v1/completions over HTTP, each stream read to its
end. Throughput is generated tokens / wall time from the first request to the
last token. Each side runs the whole batch once untimed (a GPU compiles
kernels for each new shape), then ``--repeats`` times, the two sides taking
turns so that a noisy machine hurts both alike; the report gives
medians, served / in-process, and how much of the served engine's busy time
went to socket work between steps (the rest is Engine.step()).

    python -m bench.serving [--streams 16] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

# EngineConfig fields, the same in process and for `mlxd engine` (as flags: ENGINE_FLAGS).
ENGINE_SETTINGS = dict(max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=2048, max_model_len=2048,
                       enable_prefix_caching=False)


def _engine_flags(settings: dict) -> list[str]:
    """The `mlxd engine` flags of EngineConfig fields (bench stays below the CLI: no import of it)."""
    out = []
    for name, value in settings.items():
        flag = name.replace("_", "-")
        out += ([f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)])
    return out


ENGINE_FLAGS = _engine_flags(ENGINE_SETTINGS)


_WORDS = ("river stone lamp orbit quiet violet harbor maple signal copper meadow lantern falcon "
          "ember tide glass thunder willow cobalt saffron").split()


def make_prompts(url: str, n: int, seed: int, lo=24, hi=96) -> list[list[int]]:
    """n prompts of random words, as token ids (the served tokenizer's), of mixed lengths."""
    rng = np.random.default_rng(seed)
    prompts = []
    for k in rng.integers(lo, hi, size=n):
        text = " ".join(rng.choice(_WORDS, size=int(k)))
        prompts.append(httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"])
    return prompts


class InProcess:
    """An Engine in this process, running the whole batch on demand."""

    def __init__(self, model: str = ""):
        from mlxd.engined.device import load_fast_blas

        load_fast_blas()  # before mlx.core (engined/device.py)
        from mlxd.engined.engine import Engine
        from mlxd.shared.config import EngineConfig

        self.engine = Engine(EngineConfig(**ENGINE_SETTINGS, model=model))
        self.runs = 0

    def run(self, prompts, max_tokens: int) -> tuple[float, int, int, float]:
        """(tokens/s, tokens, steps, seconds inside step()) of one batch."""
        from mlxd.shared.protocol import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.runs += 1
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            self.engine.add_request(f"r{self.runs}-{i}", p, params)
        n = steps = 0
        step_s = 0.0
        while self.engine.has_unfinished():
            s0 = time.perf_counter()
            outs = self.engine.step()
            step_s += time.perf_counter() - s0
            steps += 1
            n += sum(len(o.new_token_ids) for o in outs)
        return n / (time.perf_counter() - t0), n, steps, step_s


def _worker(model: str) -> None:
    """Child process: one InProcess engine; each stdin line {prompts, max_tokens} -> one JSON result line."""
    runner = InProcess(model)
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print(json.dumps(runner.run(job["prompts"], job["max_tokens"])), flush=True)


async def _stream(http: httpx.AsyncClient, url: str, prompt, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


async def _served_run(url: str, prompts, max_tokens: int, gateway_pid: int):
    """(tokens/s, tokens, engine steps, seconds in steps, seconds of socket work, gateway CPU s)."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        before = (await http.get(url + "/health?fresh=1")).json()["engine"]
        cpu0 = _cpu_seconds(gateway_pid)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_stream(http, url, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
        cpu = _cpu_seconds(gateway_pid) - cpu0
        after = (await http.get(url + "/health?fresh=1")).json()["engine"]
    return (sum(counts) / wall, sum(counts), after["num_steps"] - before["num_steps"],
            after["step_seconds"] - before["step_seconds"], after["io_seconds"] - before["io_seconds"], cpu)


def wait_healthy(url: str, *procs: subprocess.Popen, timeout: float = 300) -> None:
    """Until the gateway at ``url`` answers /health 200; raises if one of ``procs`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("the engine or gateway exited during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not come up")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--model", default="", help="default: the embedded SmolLM2")
    ap.add_argument("--random-model", metavar="DIR",
                    help="write a random-weight llama of SmolLM2-135M's shape to DIR and serve it "
                         "(for machines without the GGUF; throughput depends on shape, not weights)")
    args = ap.parse_args()
    if args.random_model:
        from tests.tiny_models import make_tiny_model

        make_tiny_model(args.random_model, "llama", hidden_size=576, num_hidden_layers=30,
                        intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, vocab_size=49152)
        args.model = args.random_model
    model_flags = ["--model", args.model] if args.model else []

    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/engine.sock"
        engine = subprocess.Popen([sys.executable, "-m", "mlxd", "engine", "--engine-endpoint", endpoint,
                                   "--log-level", "WARNING", *ENGINE_FLAGS, *model_flags])
        gateway = subprocess.Popen([sys.executable, "-m", "mlxd", "gateway", "--log-level", "WARNING",
                                    "--engine-endpoint", endpoint, "--port", str(args.port)])
        url = f"http://127.0.0.1:{args.port}"
        try:
            wait_healthy(url, engine, gateway)
            prompts = make_prompts(url, args.streams, seed=0)
            # The in-process engine lives in a child of its own; runs alternate between
            # the two so that a noisy machine hurts both alike. Run 0 of each is untimed.
            worker = subprocess.Popen(
                [sys.executable, "-c", f"from bench.serving import _worker; _worker({args.model!r})"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                while worker.stdout.readline().strip() != "ready":
                    if worker.poll() is not None:
                        raise RuntimeError("the in-process engine failed to start")
                local, served = [], []
                for r in range(args.repeats + 1):
                    se = asyncio.run(_served_run(url, prompts, args.max_tokens, gateway.pid))
                    worker.stdin.write(json.dumps({"prompts": prompts, "max_tokens": args.max_tokens}) + "\n")
                    worker.stdin.flush()
                    lo = json.loads(worker.stdout.readline())
                    if r:
                        local.append(lo)
                        served.append(se)
            finally:
                worker.stdin.close()
                worker.wait(60)
        finally:
            for proc in (gateway, engine):
                proc.terminate()
                proc.wait(30)
    for r, (lo, se) in enumerate(zip(local, served)):
        print(f"run {r}: in-process {lo[0]:.1f} tok/s ({lo[1]} tokens, {lo[2]} steps, {lo[3]:.2f} s in steps); "
              f"served {se[0]:.1f} tok/s ({se[1]} tokens, {se[2]} steps, {se[3]:.2f} s in steps, "
              f"{se[4]:.3f} s of socket work)", flush=True)
    lm = statistics.median(x[0] for x in local)
    sm = statistics.median(x[0] for x in served)
    step = sum(x[3] for x in served)
    io = sum(x[4] for x in served)
    print(f"{args.streams} streams x {args.max_tokens} tokens: in-process {lm:.1f} tok/s, "
          f"served {sm:.1f} tok/s, served / in-process = {sm / lm:.3f}")
    print(f"served engine loop: {step:.2f} s in steps, {io:.3f} s of socket work between them "
          f"({100 * io / max(step + io, 1e-9):.2f} % of its busy time)")
    tokens = sum(x[1] for x in served)
    gw_cpu = sum(x[5] for x in served)
    if gw_cpu:
        print(f"gateway: {1e6 * gw_cpu / tokens:.0f} us of CPU per streamed token "
              f"(one gateway process keeps up with about {tokens / gw_cpu:.0f} tok/s)")


if __name__ == "__main__":
    main()
