"""Pipeline and tensor parallelism against one process, same model, same requests, one run.

Each configuration (1 rank; pipelines of 2 and 3 ranks with one batch in
flight and with one per rank; tensor parallelism of 2 or 3) runs as its own
rank-0 process (``--run``) with its other ranks started by ``mlxd.ranks`` over
loopback (on a host with an NVIDIA GPU per rank, each rank on its own); the
first configuration is the reference the others' outputs are checked against.

One batch (the default): ``--requests`` prompts of ``--prompt-len`` tokens at
once. Reports generated tokens/s, the ratio to one rank, the steps whose last
stage ran while a later batch was out, and the pipeline's idle fraction: each
of N ranks computes its 1/N of the layers of the whole work, T_1 / N of busy
time, while the run takes T_N, so a rank idles 1 - (T_1 / N) / T_N of it (an
estimate: it charges transfers to idling).

Serving levels (``--concurrency 1,16,64``): at each level c new mixed prompts
(uniform in 256-2048 tokens, as ``bench.gpu_serving``'s) arrive at once, after
an untimed warm-up on prompts of its own; every level's prompts are new to the
process, and every configuration gets the same ones. Reports TTFT p50, each
request's decode rate (its tokens after the first over the time they took,
median) and total tokens/s (prompt + generated over the wall time), each with
its ratio to the first configuration.

On a 2-core CPU the ranks share the cores, so this checks that work is spread
and outputs are kept, not speed; on a machine with one accelerator per rank
the same script measures the real thing. ``--shape llama-8b`` (or ``qwen3-8b``)
writes a model of that shape with random bf16 weights first (no download).

    python -m bench.pipeline [--model PATH | --shape llama-8b] [--requests 8] [--max-tokens 32]
        [--configs "1 rank,pipeline x2"] [--concurrency 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from mlxd.bench.gpu_serving import SHAPES as SERVING_SHAPES
from mlxd.bench.gpu_serving import prompt_lengths, prompts_for
from mlxd.shared.config import EngineConfig

CONFIGS = {
    "1 rank": {},
    "1 rank sync": {"async_scheduling": False},  # as a pipeline schedules (a GPU's default is async)
    "pipeline x2 one batch": {"pipeline_parallel_size": 2, "pipeline_batches": 1},
    "pipeline x2": {"pipeline_parallel_size": 2},  # a batch per rank in flight
    "pipeline x3 one batch": {"pipeline_parallel_size": 3, "pipeline_batches": 1},
    "pipeline x3": {"pipeline_parallel_size": 3},
    "tensor x2": {"tensor_parallel_size": 2},
    "tensor x3": {"tensor_parallel_size": 3},  # SmolLM2 has 3 KV heads
}
CPU_CONFIGS = "1 rank,pipeline x2 one batch,pipeline x2,pipeline x3 one batch,pipeline x3,tensor x3"

SHAPES = {
    # A smoke-test shape: the --shape path end to end in seconds on a CPU.
    "llama-tiny": dict(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096,
                       tie_word_embeddings=False, torch_dtype="bfloat16"),
    # A 1B-class shape: small enough to compare in float32 (are bf16 differences rounding or a fault?).
    "llama-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                     rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                     tie_word_embeddings=True, torch_dtype="bfloat16"),
    "llama-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                     tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen3-8b": dict(SERVING_SHAPES["qwen3-8b"], torch_dtype="bfloat16"),
}


def write_random_model(directory: Path, name: str, dtype: str = "bfloat16") -> Path:
    """A model directory of shape ``name`` with random weights in ``dtype`` (and a tokenizer of its vocabulary)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from tests.tiny_models import make_tiny_model

    shape = dict(SHAPES[name], torch_dtype=dtype)
    # The tiny model's files with this vocabulary, then the real shape's config and weights over them.
    make_tiny_model(directory, shape["model_type"], num_hidden_layers=1, vocab_size=shape["vocab_size"])
    model_cls, args_cls = _get_classes(shape)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(shape))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(shape, indent=2))
    return directory


def _rank0(config: EngineConfig, job: dict) -> dict:
    """Rank 0 in this process: warm up on prompts of its own, then time ``job``'s batch or its levels."""
    from mlxd import ranks

    children = ranks.start_local(config) if config.num_ranks > 1 else []
    try:
        from mlxd.engined.device import load_fast_blas

        load_fast_blas()
        from mlxd.engined.engine import Engine
        from mlxd.shared.protocol import SamplingParams

        engine = Engine(config)
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
        engine.generate(job["warmup"], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        if "levels" in job:
            return {"levels": [_level(engine, prompts, params) for prompts in job["levels"]]}
        steps, overlapped = engine.num_steps, getattr(engine.runner, "num_overlapped", 0)
        start = time.perf_counter()
        tokens = engine.generate(job["prompts"], params)
        return {"seconds": time.perf_counter() - start, "tokens": tokens, "steps": engine.num_steps - steps,
                "overlapped": getattr(engine.runner, "num_overlapped", 0) - overlapped}
    finally:
        for child in children:
            child.terminate()
            child.wait()


def _level(engine, prompts: list[list[int]], params) -> dict:
    """``prompts`` added at once and stepped to the end: each one's tokens, TTFT and decode rate."""
    ids = [f"level-{len(prompts)}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while len(last) < len(ids):
        for _, err in engine.take_errors():
            raise err
        for out in engine.step():
            if out.request_id in tokens and out.new_token_ids:
                now = time.perf_counter()
                tokens[out.request_id].extend(out.new_token_ids)
                first.setdefault(out.request_id, now)
                if out.finish_reason:
                    last[out.request_id] = now
    return {"seconds": time.perf_counter() - start, "tokens": [tokens[r] for r in ids],
            "ttft": [first[r] - start for r in ids],
            "decode": [(len(tokens[r]) - 1) / (last[r] - first[r]) for r in ids if last[r] > first[r]],
            "prompt_tokens": sum(map(len, prompts))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="model (default: the embedded SmolLM2, 30 layers)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a model of this shape with random weights")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="of --shape's weights")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--configs", default=CPU_CONFIGS, help="comma-separated names of CONFIGS, the reference first")
    ap.add_argument("--concurrency", help="serving levels, e.g. 1,16,64 (instead of one batch)")
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="0: sized by the memory guard")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run", help=argparse.SUPPRESS)  # internal: CONFIG_JSON JOB_JSON_PATH
    args, rest = ap.parse_known_args()
    if args.run:
        config = msgspec.json.decode(args.run, type=EngineConfig)
        print(json.dumps(_rank0(config, json.loads(Path(rest[0]).read_text()))), flush=True)
        return 0
    names = [n.strip() for n in args.configs.split(",")]
    print(f"seed {args.seed}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-") as tmp:
        model = str(write_random_model(Path(tmp) / args.shape, args.shape, args.dtype)) if args.shape else args.model
        return _compare(args, model, names, Path(tmp))


def _compare(args, model: str, names: list[str], tmp: Path) -> int:
    rng = np.random.default_rng(args.seed)
    top = min(20000, SHAPES[args.shape]["vocab_size"]) if args.shape else 20000
    levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else []
    if levels:
        # Each level's prompts new to the process (the warm-up's too); the same for every configuration.
        job = {"warmup": prompts_for("mixed", prompt_lengths("mixed", 1, rng), rng, top),
               "levels": [prompts_for("mixed", prompt_lengths("mixed", c, rng), rng, top) for c in levels]}
        longest, seqs = max(len(p) for level in job["levels"] for p in level), max(levels)
    else:
        job = {"warmup": [rng.integers(100, top, args.prompt_len).tolist()],
               "prompts": [rng.integers(100, top, args.prompt_len).tolist() for _ in range(args.requests)]}
        longest, seqs = args.prompt_len, args.requests
    job["max_tokens"] = args.max_tokens
    (tmp / "job.json").write_text(json.dumps(job))
    base = dict(model=model, max_model_len=longest + args.max_tokens + 16, num_kv_blocks=args.num_kv_blocks or None,
                gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    results, refused = {}, {}
    for name in names:
        config = EngineConfig(**base, **CONFIGS[name])
        out = subprocess.run([sys.executable, "-m", "mlxd.bench.pipeline", "--run", msgspec.json.encode(config).decode(),
                              str(tmp / "job.json")], capture_output=True, text=True)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
            # A configuration the memory guard refuses (a model one GPU cannot hold) is a row of its own.
            errors = [line for line in out.stderr.splitlines() if "MemoryBudgetError" in line]
            if not errors:
                return 1
            refused[name] = errors[-1].split("MemoryBudgetError", 1)[1].lstrip(": ")
            continue
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name}: done", file=sys.stderr, flush=True)
    for name, why in refused.items():
        print(f"{name}: refused by the memory guard: {why}\n")
    if not results:
        return 1
    if levels:
        _levels_table(args, results, levels)
        return 0
    one = results[names[0]]
    generated = args.requests * args.max_tokens
    print(f"{args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} generated tokens, greedy\n")
    print("| configuration | seconds | generated tok/s | vs 1 rank | requests equal (first difference at) "
          "| steps (with a later batch out) | idle fraction per rank |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        n = CONFIGS[name].get("pipeline_parallel_size", 1)
        idle = f"{1 - (one['seconds'] / n) / r['seconds']:.2f}" if n > 1 else "-"
        print(f"| {name} | {r['seconds']:.2f} | {generated / r['seconds']:.1f} | {one['seconds'] / r['seconds']:.2f}x "
              f"| {agreement(first_differences(r['tokens'], one['tokens']))} | {r['steps']} ({r['overlapped']}) | {idle} |")
    return 0


def _levels_table(args, results: dict, levels: list[int]) -> None:
    names = list(results)
    print(f"mixed prompts of 256-2048 tokens + {args.max_tokens} generated, greedy; ratios to {names[0]}\n")
    print("| configuration | c | TTFT p50 (s) | decode tok/s per request (median) | total tok/s | TTFT ratio "
          "| decode ratio | total ratio | requests equal (first difference at) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, c in enumerate(levels):
        ref = _figures(results[names[0]]["levels"][i])
        for name in names:
            r = results[name]["levels"][i]
            f = _figures(r)
            print(f"| {name} | {c} | {f[0]:.3f} | {f[1]:.1f} | {f[2]:.0f} | {f[0] / ref[0]:.2f}x | "
                  f"{f[1] / ref[1]:.2f}x | {f[2] / ref[2]:.2f}x | "
                  f"{agreement(first_differences(r['tokens'], results[names[0]]['levels'][i]['tokens']))} |")


def _figures(level: dict) -> tuple[float, float, float]:
    """(TTFT p50, median decode tok/s per request, total tok/s) of one level's run."""
    generated = sum(map(len, level["tokens"]))
    return (float(np.median(level["ttft"])), float(np.median(level["decode"])),
            (level["prompt_tokens"] + generated) / level["seconds"])


def first_differences(got: list[list[int]], want: list[list[int]]) -> list[int | None]:
    """Per request, the first generated position where its tokens differ from the reference's (None: equal)."""
    return [None if g == w else next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
            for g, w in zip(got, want)]


def agreement(differ: list[int | None]) -> str:
    """How many requests' tokens equal the reference's, and the earliest generated token where one differs."""
    firsts = [d for d in differ if d is not None]
    return f"{len(differ) - len(firsts)}/{len(differ)}" + (f" (token {min(firsts)})" if firsts else "")


if __name__ == "__main__":
    sys.exit(main())
