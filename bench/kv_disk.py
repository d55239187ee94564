"""Does the KV disk cache cut the TTFT of agent sessions that return after their blocks left memory?

A caching workload (its table reports ``cached_tokens``). In the in-process
Engine, with the disk tier off and on (``--kv-disk-cache``), on the same
model and prompts:

- evicting: ``--sessions`` sessions of ``--context`` tokens each (system
  prompt, tools, files: random token ids, one seed per session) take their
  first turn one after another over a pool that holds ``--pool-sessions`` of
  them; then each returns with ``--turn-tokens`` new tokens. By then most of
  its blocks were evicted: without the tier it is recomputed, with it read
  back from disk.
- restart: the same first turns, then the engine is replaced by a new one (a
  restart: the RAM prefix cache is empty), then the returning turns.
- one-shot: ``--one-shot`` sessions that never return, ``--concurrency`` at a
  time, over the same small pool: their tokens/s with the tier (every eviction
  is written) against without, ``--one-shot-repeats`` times each, the order
  alternating (off then on, on then off, ...) and new prompts every repeat,
  so that neither side gains from running second or from a warmer machine.

Returning sessions' TTFT is the time from ``add_request`` to the first token,
one session at a time (the prefill alone); the table gives p50 and p90 and the
mean ``cached_tokens`` of the returning turns, and whether their greedy tokens
are the same with the tier as without.

``--shape`` (``bench/gpu_serving.py``'s shapes, random weights, no model
download) runs where no checkpoint is at hand, e.g. on a GPU machine.

    python -m bench.kv_disk [--model PATH | --shape qwen3-8b] [--sessions 16] [--context 8192] [--pool-sessions 4]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

from mlxd.engined.device import load_fast_blas

# A benchmark script, run as __main__: the fast BLAS before the imports below load mlx.core (without it MLX's
# CPU backend runs its reference BLAS, about 80x slower).
load_fast_blas()
import mlx.core as mx
import numpy as np

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams


def make_engine(args, tier: bool, disk_dir: str) -> Engine:
    """An engine over a model object of its own (an engine adapts the model's layers it is given)."""
    session = args.context + args.turn_tokens + 2 * args.max_tokens
    blocks = -(-session // args.block_size)
    return Engine(EngineConfig(
        num_kv_blocks=max(args.pool_sessions, args.concurrency) * blocks, block_size=args.block_size,
        max_model_len=session + args.block_size, max_num_seqs=max(args.concurrency, 1),
        kv_disk_cache=tier, kv_cache_dir=disk_dir, kv_disk_budget=args.disk_budget), loaded=args.make_loaded())


def ttft(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[float, int, list[int]]:
    """(seconds to the first token, cached prompt tokens, tokens) of one request run alone to its end."""
    start, first, cached, tokens = time.perf_counter(), None, 0, []
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.new_token_ids:
                first, cached = time.perf_counter() - start, out.num_cached_tokens
            tokens += out.new_token_ids
    return first, cached, tokens


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[float, int]:
    """Run ``prompts`` together to their ends; (seconds, tokens prefilled and generated)."""
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, sum(map(len, prompts)) + len(prompts) * params.max_tokens


def close_tier(engine: Engine) -> None:
    """Let the tier's writer finish before its folder is removed (a write still queued would race the removal)."""
    if engine.scheduler.kv.disk is not None:
        engine.scheduler.kv.disk.store.close()


def returning(vocab: int, args, tier: bool, restart: bool) -> tuple[list[float], list[int], list[list[int]]]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(args.seed)
    contexts = [rng.integers(100, vocab - 100, size=args.context).tolist() for _ in range(args.sessions)]
    turns = [rng.integers(100, vocab - 100, size=args.turn_tokens).tolist() for _ in range(args.sessions)]
    with tempfile.TemporaryDirectory(dir=args.kv_cache_dir) as disk_dir:
        engine = make_engine(args, tier, disk_dir)
        for i, c in enumerate(contexts):
            ttft(engine, f"first{i}", c, params)
        if restart:
            engine.release_idle_memory()  # its first idle moment: the tier writes what a restart finds
            close_tier(engine)
            del engine
            gc.collect()
            mx.clear_cache()
            engine = make_engine(args, tier, disk_dir)
        elif engine.scheduler.kv.disk is not None:
            engine.scheduler.kv.disk.store.flush()  # the evictions' writes are done before sessions return
        times, cached, tokens = [], [], []
        for i, (c, t) in enumerate(zip(contexts, turns)):
            s, n, out = ttft(engine, f"again{i}", c + t, params)
            times.append(s)
            cached.append(n)
            tokens.append(out)
        close_tier(engine)
        tier_state = engine.scheduler.kv.disk
        if tier_state is not None:  # why a returning turn found what it found (disk_tier's rules)
            t = tier_state.store.totals
            rate = tier_state.read_rate.value or 0.0
            print(f"  tier: {t.hit_blocks} blocks read back, {t.declined_reads} reads declined (recompute faster), "
                  f"{t.dropped_writes} writes dropped (writer behind), read {rate / 1e9:.2f} GB/s, prefill "
                  f"{tier_state.prefill_rate.value or 0.0:.0f} tokens/s", flush=True)
        return times, cached, tokens


def one_shot(vocab: int, args, tier: bool, repeat: int) -> float:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng([args.seed, 1, repeat])
    prompts = [rng.integers(100, vocab - 100, size=args.context).tolist() for _ in range(args.one_shot)]
    with tempfile.TemporaryDirectory(dir=args.kv_cache_dir) as disk_dir:
        engine = make_engine(args, tier, disk_dir)
        seconds = tokens = 0
        for k in range(0, len(prompts), args.concurrency):
            s, n = run_all(engine, prompts[k:k + args.concurrency], params, f"one{k}-")
            seconds, tokens = seconds + s, tokens + n
        close_tier(engine)
        return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--shape", default=None, help="random weights of this shape (bench/gpu_serving.py) instead")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "q4", "f32"], help="with --shape")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--pool-sessions", type=int, default=4, help="sessions the RAM pool holds")
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--one-shot", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4, help="one-shot sessions at a time")
    ap.add_argument("--one-shot-repeats", type=int, default=3, help="one-shot runs with the tier and without, each")
    ap.add_argument("--workloads", default="evicting,restart,one-shot")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--disk-budget", type=int, default=64 * 2**30)
    ap.add_argument("--kv-cache-dir", default=None, help="where the tier's folder is made (default: the temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"seed {args.seed}", flush=True)

    if args.shape:
        from mlxd.bench.gpu_serving import SHAPES, build_models

        _, args.make_loaded, _ = build_models(args.shape, args.dtype, args.seed)
        vocab = SHAPES[args.shape]["vocab_size"]
    else:
        args.make_loaded = lambda: load_model(args.model)
        vocab = load_model(args.model).vocab_size
    workloads = args.workloads.split(",")
    rows = []
    for workload in [w for w in ("evicting", "restart") if w in workloads]:
        outputs = {}
        for tier in (False, True):
            times, cached, outputs[tier] = returning(vocab, args, tier, restart=workload == "restart")
            p50, p90 = np.percentile(times, [50, 90])
            rows.append((workload, tier, p50, p90, float(np.mean(cached))))
            print(f"{workload:>8} tier {'on ' if tier else 'off'}: returning TTFT p50 {p50:.3f} s p90 {p90:.3f} s, "
                  f"cached_tokens {np.mean(cached):.0f}", flush=True)
        same = sum(a == b for a, b in zip(outputs[False], outputs[True]))
        print(f"{workload:>8}: {same} of {args.sessions} returning sessions gave the same greedy tokens with the "
              "tier as without", flush=True)
    throughput: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.one_shot_repeats if "one-shot" in workloads else 0):
        for tier in (False, True) if r % 2 == 0 else (True, False):
            throughput[tier].append(one_shot(vocab, args, tier, r))
            print(f"one-shot run {r} tier {'on ' if tier else 'off'}: {throughput[tier][-1]:.1f} tokens/s", flush=True)

    if rows:
        print(f"\n{args.sessions} sessions of {args.context} tokens over a pool of {args.pool_sessions}")
        print("\n| workload | disk tier | returning TTFT p50 (s) | p90 (s) | cached_tokens (mean) | on/off p50 |")
        print("|---|---|---|---|---|---|")
    off = {w: p50 for w, t, p50, _, _ in rows if not t}
    for w, t, p50, p90, c in rows:
        print(f"| {w} | {'on' if t else 'off'} | {p50:.3f} | {p90:.3f} | {c:.0f} | "
              f"{p50 / off[w]:.2f} |" if t else f"| {w} | off | {p50:.3f} | {p90:.3f} | {c:.0f} | |")
    if throughput[False]:
        without, with_tier = (float(np.median(throughput[t])) for t in (False, True))
        pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(throughput[True], throughput[False]))
        print(f"\n{args.one_shot} one-shot sessions of {args.context} tokens, {args.concurrency} at a time over a "
              f"pool of {args.pool_sessions} sessions; median of {args.one_shot_repeats}: {without:.1f} tokens/s "
              f"without the tier, {with_tier:.1f} with it ({with_tier / without:.2f}x; each repeat on/off: {pairs})")


if __name__ == "__main__":
    main()
