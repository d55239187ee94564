"""Serving overhead: 16 streams through gateway + wire against the in-process Engine.

Both sides run the same engine settings, the same token-id prompts, greedy
decoding and ``ignore_eos`` (every request generates exactly ``--max-tokens``).
In-process: ``Engine.add_request`` for all, then ``step()`` until done.
Served: ``mlxd engine`` and ``mlxd gateway`` as real processes, the requests
sent at once as streamed /v1/completions over HTTP, each stream read to its
end. Throughput is generated tokens / wall time from the first request to the
last token. The runs alternate (in-process, served, ...) so that a noisy
machine hurts both alike; the report gives medians and served / in-process.

    python -m bench.serving [--streams 16] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

ENGINE_FLAGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--num-kv-blocks", "512",
                "--max-model-len", "1024", "--no-enable-prefix-caching"]


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


def in_process(prompts, max_tokens: int, model: str = "") -> tuple[float, int]:
    import engined  # noqa: F401  (the fast BLAS before mlx.core)
    from engined.engine import Engine
    from shared.cli import _build, _parser
    from shared.config import EngineConfig
    from shared.sampling import SamplingParams

    args = _parser().parse_args(["engine", *ENGINE_FLAGS, *(["--model", model] if model else [])])
    engine = Engine(_build(EngineConfig, args))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    n = 0
    while engine.has_unfinished():
        n += sum(len(o.new_token_ids) for o in engine.step())
    return n / (time.perf_counter() - t0), n


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


async def _served_run(url: str, prompts, max_tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        await _stream(http, url, prompts[0][:8], 2)  # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_stream(http, url, p, max_tokens) for p in prompts))
        return sum(counts) / (time.perf_counter() - t0), sum(counts)


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
        engine = subprocess.Popen([sys.executable, "-m", "engined", "--engine-endpoint", endpoint,
                                   "--log-level", "WARNING", *ENGINE_FLAGS, *model_flags])
        gateway = subprocess.Popen([sys.executable, "-m", "shared.cli", "gateway", "--log-level", "WARNING",
                                    "--engine-endpoint", endpoint, "--port", str(args.port)])
        url = f"http://127.0.0.1:{args.port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("the served engine did not come up")
                time.sleep(0.5)
            prompts = make_prompts(url, args.streams, seed=0)
            local, served = [], []
            before = httpx.get(url + "/health?fresh=1").json()["engine"]
            for r in range(args.repeats):
                # The in-process engine runs in a child so the two never share a process.
                out = subprocess.run(
                    [sys.executable, "-c",
                     "import json,sys; from bench.serving import in_process; "
                     f"print(json.dumps(in_process(json.loads(sys.stdin.read()), {args.max_tokens}, "
                     f"{args.model!r})))"],
                    input=json.dumps(prompts), capture_output=True, text=True, check=True)
                local.append(json.loads(out.stdout.strip().splitlines()[-1]))
                served.append(asyncio.run(_served_run(url, prompts, args.max_tokens)))
                print(f"run {r}: in-process {local[-1][0]:.1f} tok/s ({local[-1][1]} tokens), "
                      f"served {served[-1][0]:.1f} tok/s ({served[-1][1]} tokens)", flush=True)
            after = httpx.get(url + "/health?fresh=1").json()["engine"]
        finally:
            for proc in (gateway, engine):
                proc.terminate()
                proc.wait(30)
    lm = statistics.median(x[0] for x in local)
    sm = statistics.median(x[0] for x in served)
    step = after["step_seconds"] - before["step_seconds"]
    io = after["io_seconds"] - before["io_seconds"]
    print(f"{args.streams} streams x {args.max_tokens} tokens: in-process {lm:.1f} tok/s, "
          f"served {sm:.1f} tok/s, served / in-process = {sm / lm:.3f}")
    print(f"served engine loop: {step:.2f} s in steps, {io:.3f} s of socket work between them "
          f"({100 * io / max(step + io, 1e-9):.2f} % of its busy time)")


if __name__ == "__main__":
    main()
