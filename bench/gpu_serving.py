"""GPU serving: mlxd's in-process Engine against mlx_lm's batch generator on the same random-weight arrays.

The model is built from a real checkpoint's shape with random weights (no
download): Qwen3-8B in bf16 or 4-bit, or Qwen3-30B-A3B (MoE) in 4-bit. One
set of arrays serves both sides: mlx_lm's model object runs them as they are,
mlxd's engine runs a second model object over the same arrays with its paged
attention swapped in. Every request is greedy and generates exactly
``--max-tokens`` tokens (random weights never mean to stop; neither side is
given an end token).

Closed batches (``--workloads mixed,shared``): ``c`` requests at once; mixed
prompts are uniform in 256-2048 tokens, shared ones are a common 2K prefix and
128 tokens of their own. mlxd runs ``Engine.generate``, mlx_lm its
``batch_generate`` (completion batch size ``c``); one side runs all its runs,
then the other (neither's memory held while the other runs), one untimed run
each first, the median of ``--repeats`` is reported as total tokens (prompt +
generated) per second. Every run, the untimed one included,
draws new prompts of the same lengths (a shared batch a new prefix), as a
user's traffic does: a run never finds an earlier run's prompts in mlxd's
prefix cache (prefix caching stays on, as users run it). Both sides get the
same prompts within a run (separate caches: mlx_lm's keeps none). Each mlxd
run reports ``cached_tokens``, its prompt tokens served from the prefix cache
(a shared batch's requests may find the common prefix that another request
of the batch computed), and per step the host time (inside ``step()``, not
waiting) and the time it waited on the device (``Engine.sync_wait_s``), for the
whole run and apart for its prefill phase (the steps until no prompt is left to
compute) and its decode phase.

Open loop (``--poisson RATE``): requests arrive at Poisson times, mixed
prompts, each side in this process (mlx_lm's ``BatchGenerator`` driven as its
server drives it); TTFT and inter-token latency percentiles, and mlxd's
``cached_tokens`` (its untimed warm-up runs prompts of its own).

``--roofline`` measures the bf16 matmul rate and HBM bandwidth, and each closed
batch's row then states the least time they allow for its tokens (``lower_bound``).

    python -m bench.gpu_serving --model qwen3-8b --dtype bf16 --concurrency 1,16,64,128

Over 400 lines because the closed batches, the open loop and the bound they are set against share
one model build, one prompt maker and one report.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np

SHAPES = {
    # A smoke-test shape: the script end to end in seconds on a CPU.
    "qwen3-tiny": dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
                       rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192,
                       tie_word_embeddings=False),
    # SmolLM2-135M's shape in float32: the CPU's figures (its BLAS has no fast bfloat16 or 4-bit matmul).
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                     tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, intermediate_size=6144,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768,
                          norm_topk_prob=True),
}


def build_models(name: str, dtype: str, seed: int):
    """mlx_lm's model over random arrays, and a maker of mlxd LoadedModels over the same arrays.

    Each engine swaps its model's attention for paged attention, so each gets
    a model object of its own; the arrays (the memory) are shared by all.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mlxd.engined.loaders import LoadedModel

    shape = SHAPES[name]
    model_cls, args_cls = _get_classes(shape)
    mx.random.seed(seed)

    def fresh():
        m = model_cls(args_cls.from_dict(shape))
        m.set_dtype(mx.float32 if dtype == "f32" else mx.bfloat16)
        if dtype == "q4":
            nn.quantize(m, group_size=64, bits=4)
        return m

    first = fresh()
    mx.eval(first.parameters())

    def make_loaded() -> LoadedModel:
        m = fresh()
        m.update(first.parameters())  # the very same arrays, not copies (its own random ones never evaluated)
        return LoadedModel(model=m, model_id=f"random-{name}-{dtype}", model_type=shape["model_type"],
                           tokenizer_dir=Path("."), eos_token_ids=[], bos_token_id=None,
                           context_length=8192, vocab_size=shape["vocab_size"],
                           num_layers=shape["num_hidden_layers"], num_kv_heads=shape["num_key_value_heads"],
                           head_dim=shape["head_dim"])

    n = sum(p.size for _, p in tree_flatten(first.parameters()))
    return first, make_loaded, n


def prompt_lengths(workload: str, c: int, rng: np.random.Generator) -> list[int]:
    """Each of ``c`` requests' prompt length: mixed uniform in 256-2048, shared a 2K prefix and 128 of its own."""
    return rng.integers(256, 2049, c).tolist() if workload == "mixed" else [2048 + 128] * c


def prompts_for(workload: str, lengths: list[int], rng: np.random.Generator, vocab: int) -> list[list[int]]:
    """New random prompts of ``lengths`` at every call (shared: one new prefix common to them all), so that
    no run is served from a prefix cache that an earlier run filled."""
    if workload == "mixed":
        return [rng.integers(0, vocab, n).tolist() for n in lengths]
    prefix = rng.integers(0, vocab, 2048).tolist()
    return [prefix + rng.integers(0, vocab, n - 2048).tolist() for n in lengths]


def cached_tokens(engine) -> int:
    """Prompt tokens the engine has served from its prefix cache since it started."""
    return engine.stats().prefix_cache_hits


class _NoText:
    """What batch_generate asks of a tokenizer: no end token (as mlxd's side has none), no text."""

    eos_token_ids: list[int] = []

    @staticmethod
    def decode(ids) -> str:
        return ""


# MLX's buffer-cache limit as a process starts with it (set in main): mlx_lm runs under it, as in a
# process of its own, not under the limit an engine's memory guard sets process-wide.
DEFAULT_CACHE_LIMIT: list[int] = []


def run_mlx_lm(model, prompts, max_tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import batch_generate

    engines_limit = mx.set_cache_limit(DEFAULT_CACHE_LIMIT[0])
    t0 = time.perf_counter()
    out = batch_generate(model, _NoText(), prompts, max_tokens=max_tokens, return_token_ids=True,
                         completion_batch_size=len(prompts))
    wall = time.perf_counter() - t0
    assert all(len(t) == max_tokens for t in out.token_ids)
    mx.clear_cache()
    mx.set_cache_limit(engines_limit)
    return wall


def engine_for(make_loaded, args, c: int, async_scheduling: bool, encode_thread: bool | None = None,
               compile_decode: bool | None = None):
    from mlxd.engined.engine import Engine
    from mlxd.shared.config import EngineConfig

    cfg = EngineConfig(max_num_seqs=max(c, 1), max_num_batched_tokens=args.max_num_batched_tokens,
                       num_kv_blocks=args.num_kv_blocks, max_model_len=4096, async_scheduling=async_scheduling,
                       encode_thread=encode_thread, compile_decode=compile_decode)
    return Engine(cfg, loaded=make_loaded())


def start_decoding(engine, prompts: list[list[int]], max_tokens: int) -> None:
    """Add ``prompts`` (greedy, ``max_tokens`` each) and step through their prefill and the first decode
    steps, so that the probes' timed steps are decode steps of all of them."""
    from mlxd.shared.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(-(-sum(map(len, prompts)) // engine.config.max_num_batched_tokens) + 8):
        engine.step()


def drain(engine) -> None:
    """Abort what the engine holds and step until the step in flight is read (probes end their runs this way)."""
    engine.abort(list(engine.requests))
    while engine.has_unfinished():
        engine.step()


def run_mlxd(engine, prompts, max_tokens: int) -> tuple[float, dict]:
    import mlx.core as mx

    from mlxd.shared.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    steps0, wait0, cached0 = engine.num_steps, engine.sync_wait_s, cached_tokens(engine)
    # Each step's wall and wait, split at the step after which no prompt is left to compute: the prefill
    # phase's steps (chunks, with decode rows beside them) and the decode phase's.
    phases = {"prefill": [0, 0.0, 0.0], "decode": [0, 0.0, 0.0]}  # steps, wall s, wait s
    counts, run = [0] * len(prompts), engine.num_steps
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"run{run}-{i}", prompt, params)
    prefilling, done = True, 0
    while done < len(prompts):
        for _, err in engine.take_errors():
            raise err
        t, w, n = time.perf_counter(), engine.sync_wait_s, engine.num_steps
        outputs = engine.step()
        phase = phases["prefill" if prefilling else "decode"]
        phase[0] += engine.num_steps - n  # steps launched (the last call only reads the one in flight)
        phase[1] += time.perf_counter() - t
        phase[2] += engine.sync_wait_s - w
        for o in outputs:
            counts[int(o.request_id.rsplit("-", 1)[1])] += len(o.new_token_ids)
            done += o.finish_reason is not None
        prefilling = prefilling and any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values())
    wall = time.perf_counter() - t0
    assert counts == [max_tokens] * len(prompts), counts
    steps, wait = engine.num_steps - steps0, engine.sync_wait_s - wait0
    mx.clear_cache()
    split = {}
    for name, (n, t, w) in phases.items():
        split |= {f"{name}_steps": n, f"{name}_host_ms_per_step": round(1e3 * (t - w) / max(n, 1), 2),
                  f"{name}_wait_ms_per_step": round(1e3 * w / max(n, 1), 2)}
    return wall, dict(steps=steps, host_ms_per_step=1e3 * (wall - wait) / steps, wait_ms_per_step=1e3 * wait / steps,
                      cached_tokens=cached_tokens(engine) - cached0, **split)


def closed_batches(model, make_loaded, args, rows: list) -> None:
    import mlx.core as mx

    rng = np.random.default_rng(args.seed)
    for workload in args.workloads.split(","):
        for c in map(int, args.concurrency.split(",")):
            lengths = prompt_lengths(workload, c, rng)
            total = sum(lengths) + c * args.max_tokens
            # Every run, the untimed first included, gets new prompts; both sides get the same ones.
            runs = [prompts_for(workload, lengths, rng, model.args.vocab_size) for _ in range(args.repeats + 1)]
            # One side at a time, so that neither's memory is held while the other runs: at c = 64 on an 80 GB
            # card mlx_lm's batch did not fit beside mlxd's pool. mlx_lm first; its buffers are freed after each run.
            times = {"mlx_lm": [run_mlx_lm(model, prompts, args.max_tokens) for prompts in runs][1:]}
            engines = {mode: engine_for(make_loaded, args, c, mode == "async", args.encode_thread)
                       for mode in args.modes.split(",")}
            times |= {m: [] for m in engines}
            steps = {m: [] for m in engines}
            for rep, prompts in enumerate(runs):  # the first is untimed: kernels compile for new shapes
                modes = list(engines)
                for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:  # each goes first in turn
                    wall, st = run_mlxd(engines[mode], prompts, args.max_tokens)
                    if rep:
                        times[mode].append(wall)
                        steps[mode].append(st)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = dict(model=args.label, workload=workload, c=c, tokens=total, seconds=med, each=times,
                       tok_s={k: total / v for k, v in med.items()},
                       ratio={m: med["mlx_lm"] / med[m] for m in engines},
                       steps={m: steps[m] for m in engines},
                       cached_tokens={m: [st["cached_tokens"] for st in steps[m]] for m in engines},
                       budget=args.max_num_batched_tokens)
            roof = next((r for r in rows if r.get("roofline")), None)
            if roof is not None and args.dtype == "bf16":  # the rates measured are bf16's
                row["bound"] = lower_bound(roof, SHAPES[args.model], args.weight_bytes, args.parameters, lengths,
                                           args.max_tokens, 2)
                row["over_bound"] = {m: round(med[m] / row["bound"]["bound_s"], 2) for m in med}
            rows.append(row)
            print(json.dumps(row), flush=True)
            # An engine's model and step context form reference cycles: collected, its pool's memory goes back.
            del engines
            gc.collect()
            mx.clear_cache()


def _percentiles(xs: list[float]) -> dict:
    a = np.array(xs) * 1e3
    return {f"p{q}": round(float(np.percentile(a, q)), 1) for q in (50, 90, 99)}


def poisson(model, make_loaded, args, rows: list) -> None:
    """Open-loop arrivals at ``args.poisson`` requests/s: TTFT and ITL of mlxd and of mlx_lm's generator."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from mlxd.shared.protocol import SamplingParams

    rng = np.random.default_rng(args.seed + 1)
    n = args.poisson_requests
    prompts = prompts_for("mixed", prompt_lengths("mixed", n, rng), rng, model.args.vocab_size)
    arrivals = np.cumsum(rng.exponential(1.0 / args.poisson, n))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def drive(add, step, name, cached=lambda: 0):
        cached0 = cached()
        seen: dict[int, list[float]] = {i: [] for i in range(n)}
        t0, nxt = time.perf_counter(), 0
        while nxt < n or any(len(v) < args.max_tokens for v in seen.values()):
            now = time.perf_counter() - t0
            while nxt < n and arrivals[nxt] <= now:
                add(nxt)
                nxt += 1
            got = step()
            stamp = time.perf_counter() - t0
            if not got and nxt < n:
                time.sleep(max(0.0, min(0.002, arrivals[nxt] - stamp)))
            for i, k in got:
                seen[i] += [stamp] * k
        ttft = [seen[i][0] - arrivals[i] for i in range(n)]
        itl = [b - a for i in range(n) for a, b in zip(seen[i], seen[i][1:])]
        row = dict(model=args.label, workload=f"poisson {args.poisson}/s x {n}", side=name,
                   ttft_ms=_percentiles(ttft), itl_ms=_percentiles(itl),
                   seconds=round(max(v[-1] for v in seen.values()), 2), cached_tokens=cached() - cached0)
        rows.append(row)
        print(json.dumps(row), flush=True)

    gen = BatchGenerator(model, completion_batch_size=args.poisson_batch)
    uid_of: dict[int, int] = {}

    def lm_add(i):
        (uid,) = gen.insert([prompts[i]], [args.max_tokens])
        uid_of[uid] = i

    def lm_step():
        _, responses = gen.next()
        return [(uid_of[r.uid], 1) for r in responses]

    drive(lm_add, lm_step, "mlx_lm")
    gen.close()
    mx.clear_cache()
    engine = engine_for(make_loaded, args, args.poisson_batch, True, args.encode_thread)
    # Kernels compiled before the clock starts, as mlx_lm's were, on prompts of the warm-up's own.
    engine.generate(prompts_for("mixed", [len(p) for p in prompts[:2]], rng, model.args.vocab_size), params)

    def e_add(i):
        engine.add_request(f"p{i}", prompts[i], params)

    def e_step():
        return [(int(o.request_id[1:]), len(o.new_token_ids)) for o in engine.step() if o.new_token_ids]

    drive(e_add, e_step, "mlxd", lambda: cached_tokens(engine))


def roofline(rows: list) -> None:
    """Measured bf16 matmul rate and HBM copy bandwidth (the bounds the c=64 arithmetic uses)."""
    import mlx.core as mx

    a = mx.random.normal((8192, 4096)).astype(mx.bfloat16)
    b = mx.random.normal((4096, 12288)).astype(mx.bfloat16)
    x = mx.random.normal((1 << 30,)).astype(mx.bfloat16)  # 2 GiB
    mx.eval(a, b, x)

    def timed(f, reps):
        for _ in range(3):
            mx.eval(f())
        t0 = time.perf_counter()
        mx.eval([f() for _ in range(reps)])
        return (time.perf_counter() - t0) / reps

    mm = timed(lambda: a @ b, 20)
    cp = timed(lambda: x + 1, 20)
    rd = timed(lambda: x.max(), 20)  # reads the 2 GiB once, as a decode step reads its weights
    row = dict(roofline=True, matmul_tflops=round(2 * 8192 * 4096 * 12288 / mm / 1e12, 1),
               hbm_tb_s=round(2 * x.nbytes / cp / 1e12, 2), hbm_read_tb_s=round(x.nbytes / rd / 1e12, 2))
    rows.append(row)
    print(json.dumps(row), flush=True)


def lower_bound(roof: dict, shape: dict, weight_bytes: int, params: int, lengths: list[int], max_tokens: int,
                kv_dtype_bytes: int) -> dict:
    """The least time the measured rates allow a closed batch, with its arithmetic.

    Compute: every weight matmul (2 x parameters per token, prompt and generated) and the
    prompts' causal attention (2 x length^2 x heads x head dim x layers each) at the matmul
    rate. Memory: each of the ``max_tokens`` forward passes a request needs one after another
    reads the weights once, and each generated token reads its context's K/V once, at the read
    bandwidth. A step takes at least the longer of its two, so no schedule beats the longer sum;
    a scheduler that rides decode tokens on prefill steps can approach it.
    """
    heads, dim, layers = shape["num_attention_heads"], shape["head_dim"], shape["num_hidden_layers"]
    kv_per_token = layers * shape["num_key_value_heads"] * dim * 2 * kv_dtype_bytes
    tokens = sum(lengths) + len(lengths) * max_tokens
    flops = 2 * params * tokens + sum(2 * n * n * heads * dim * layers for n in lengths)
    kv_read = kv_per_token * sum(max_tokens * n + max_tokens * (max_tokens - 1) // 2 for n in lengths)
    compute_s = flops / (roof["matmul_tflops"] * 1e12)
    memory_s = (max_tokens * weight_bytes + kv_read) / (roof["hbm_read_tb_s"] * 1e12)
    return dict(flops=flops, weight_reads_bytes=max_tokens * weight_bytes, kv_read_bytes=kv_read,
                compute_s=round(compute_s, 3), memory_s=round(memory_s, 3), bound_s=round(max(compute_s, memory_s), 3))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "q4", "f32"))
    ap.add_argument("--workloads", default="mixed,shared")
    ap.add_argument("--concurrency", default="1,16,64,128")
    ap.add_argument("--modes", default="async", help="mlxd modes to run: async, sync or both (async,sync)")
    ap.add_argument("--encode-thread", action=argparse.BooleanOptionalAction,
                    help="the engines encode each step on a thread of their own (default: the device's default)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=24576)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--poisson", type=float, default=0.0, help="open-loop arrival rate, requests/s (0: none)")
    ap.add_argument("--poisson-requests", type=int, default=64)
    ap.add_argument("--poisson-batch", type=int, default=64)
    ap.add_argument("--roofline", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    print(f"seed {args.seed}", flush=True)
    import mlx.core as mx
    from mlx.utils import tree_flatten

    DEFAULT_CACHE_LIMIT.append(mx.set_cache_limit(0))
    mx.set_cache_limit(DEFAULT_CACHE_LIMIT[0])
    rows: list = []
    if args.roofline:
        roofline(rows)
    model, make_loaded, n = build_models(args.model, args.dtype, args.seed)
    args.label = f"{args.model} {args.dtype}"
    args.parameters = n
    args.weight_bytes = sum(p.nbytes for _, p in tree_flatten(model.parameters()))  # 4-bit: packed, with scales
    print(json.dumps(dict(model=args.label, parameters=n, weight_bytes=args.weight_bytes)), flush=True)
    if args.concurrency:
        closed_batches(model, make_loaded, args, rows)
    if args.poisson:
        poisson(model, make_loaded, args, rows)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
