"""A decode step with and without one of the host-time changes of issue 26, alternating in one process.

``--compare qk-rope``: the q/k/v kernel (``engined.kernels.qk_rope``) against
MLX's operations; ``--compare encode-thread``: each step's graph encoded on a
thread of its own (``engined/fastpath/encode_thread.py``) against on the engine's;
``--compare lean-graph``: linears holding their weight's transpose
(``engined/fastpath/transposed_linear.py``) and the 2-D stream (``model_layers.FLAT_STREAM``)
against mlx's own linears on the packed ``[1, T, hidden]`` stream (~180 graph nodes a
step more at 36 layers); ``--compare compiled``: decode steps replayed from compiled traces
(``engined/fastpath/compiled_decode.py``) against built layer by layer in Python. The other changes
are on in both engines, as the device's defaults have them.
Two asynchronous engines over the same random weights of a real shape (bf16),
the change on in one ("new") and off in the other ("old"), each with c requests of 512-token
prompts decoding; then rounds of ``--steps`` timed steps on each in turn, the
order flipped every round. Per engine: ms per step, the part the engine's thread
waits (for the device, and for the encode thread where there is one), the rest
(the engine's thread's host time), and the time MLX spends encoding a step in
``mx.async_eval``, on whichever thread; medians over the rounds; and the ratios.

    python -m bench.gpu_step_ab --compare qk-rope [--levels 1,16,64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main(argv=None) -> None:
    import mlx.core as mx

    from bench.gpu_serving import DEFAULT_CACHE_LIMIT, build_models, drain, engine_for, start_decoding
    from engined.model_layers import transformer_layers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", required=True, choices=("qk-rope", "encode-thread", "lean-graph", "compiled"))
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--out", help="append the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    DEFAULT_CACHE_LIMIT.append(mx.set_cache_limit(0))
    mx.set_cache_limit(DEFAULT_CACHE_LIMIT[0])
    model, make_loaded, _ = build_models(args.model, "bf16", 0)
    rng = np.random.default_rng(0)
    steps_needed = args.rounds * args.steps + 16
    print(f"{args.compare}, new against old (encode: ms a step in mx.async_eval, on whichever thread runs it)\n"
          "| c | new ms/step (wait) | old ms/step (wait) | new host | old host | new encode | old encode | "
          "step ratio | host ratio |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for c in map(int, args.levels.split(",")):
        engines = {}
        prompts = [rng.integers(0, model.args.vocab_size, 512).tolist() for _ in range(c)]
        for way in ("new", "old"):
            thread = way == "new" if args.compare == "encode-thread" else None  # None: the device's default
            engine = engine_for(make_loaded, args, c, True, encode_thread=thread,
                                compile_decode=way == "new" if args.compare == "compiled" else None)
            layers = [layer.self_attn for layer in transformer_layers(engine.loaded.model)]
            if args.compare == "qk-rope" and way == "old":
                for attn in layers:
                    attn._qk_rope = None
            elif args.compare == "qk-rope" and not all(attn._qk_rope is not None for attn in layers):
                raise SystemExit("the kernel is not on in every layer: not a CUDA machine?")
            if args.compare == "lean-graph" and way == "old":
                packed_with_mlx_linears(engine)
            if args.compare == "encode-thread" and (engine.encoder is not None) is not thread:
                raise SystemExit("the encode thread is not as asked")
            if args.compare == "compiled" and (engine.runner.compiled is not None) is not (way == "new"):
                raise SystemExit("compiled decode is not as asked")
            if args.compare == "compiled" and way == "new":
                engine.runner.compiled = TimedReplay(engine.runner.compiled)
            start_decoding(engine, prompts, steps_needed + 16)
            engines[way] = engine
        got = {way: [] for way in engines}
        encode = {way: [] for way in engines}
        tokens = {way: {} for way in engines}  # each request's greedy tokens, for the two engines' agreement
        real, spent = mx.async_eval, [0.0]

        def timed_async_eval(*arrays):  # the engine's own thread's encoding, where it encodes
            t0 = time.perf_counter()
            real(*arrays)
            spent[0] += time.perf_counter() - t0

        for r in range(args.rounds):
            for way in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                engine = engines[way]
                e0 = engine.encoder.encode_s if engine.encoder is not None else 0.0
                t0, w0, spent[0] = time.perf_counter(), engine.sync_wait_s, 0.0
                mx.async_eval = timed_async_eval
                try:
                    for _ in range(args.steps):
                        for out in engine.step():
                            tokens[way].setdefault(out.request_id, []).extend(out.new_token_ids)
                finally:
                    mx.async_eval = real
                dt, wait = time.perf_counter() - t0, engine.sync_wait_s - w0
                enc = engine.encoder.encode_s - e0 if engine.encoder is not None else spent[0]
                got[way].append((1e3 * dt / args.steps, 1e3 * wait / args.steps))
                encode[way].append(1e3 * enc / args.steps)
        med = {way: (statistics.median(s for s, _ in v), statistics.median(w for _, w in v)) for way, v in got.items()}
        (ns, nw), (os_, ow) = med["new"], med["old"]
        enc = {way: statistics.median(v) for way, v in encode.items()}
        # Same weights, prompts and steps: a change that computes what it replaces gives the same tokens up
        # to rounding (a rounding that flips one token changes that request's tokens after it).
        pairs = [(a, tokens["old"].get(rid, [])) for rid, a in tokens["new"].items()]
        same = sum(x == y for a, b in pairs for x, y in zip(a, b))
        compared = sum(min(len(a), len(b)) for a, b in pairs)
        print(f"  c={c}: tokens equal in the two engines' timed steps: {same} of {compared}", flush=True)
        if args.compare == "compiled":
            compiled = engines["new"].runner.compiled
            replay_ms = 1e3 * compiled.replay_s / max(compiled.replays, 1)
            print(f"  c={c}: steps replayed {compiled.calls}, traces {compiled.traces}; the engine thread's call "
                  f"that replays a step (most of it MLX's C++, holding Python's lock) {replay_ms:.2f} ms", flush=True)
        row = dict(compare=args.compare, model=args.model, c=c, new_ms=round(ns, 2), new_wait=round(nw, 2),
                   tokens_equal=same, tokens_compared=compared,
                   old_ms=round(os_, 2), old_wait=round(ow, 2), new_encode_ms=round(enc["new"], 2),
                   old_encode_ms=round(enc["old"], 2),
                   rounds={w: [[round(a, 2), round(b, 2)] for a, b in v] for w, v in got.items()})
        print(f"| {c} | {ns:.2f} ({nw:.2f}) | {os_:.2f} ({ow:.2f}) | {ns - nw:.2f} | {os_ - ow:.2f} | "
              f"{enc['new']:.2f} | {enc['old']:.2f} | {os_ / ns:.2f}x | {(os_ - ow) / (ns - nw):.2f}x |", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        for engine in engines.values():
            drain(engine)
        del engines
        mx.clear_cache()


class TimedReplay:
    """``--compare compiled``'s new engine's ``CompiledDecode``, timing its calls that replay a trace."""

    def __init__(self, compiled):
        self._compiled, self.replay_s, self.replays = compiled, 0.0, 0

    def __call__(self, *args):
        calls, traces, t0 = self._compiled.calls, self._compiled.traces, time.perf_counter()
        out = self._compiled(*args)
        if self._compiled.calls > calls and self._compiled.traces == traces:  # replayed, not traced
            self.replay_s += time.perf_counter() - t0
            self.replays += 1
        return out

    def __getattr__(self, name):
        return getattr(self._compiled, name)


def packed_with_mlx_linears(engine) -> None:
    """``--compare lean-graph``'s old engine: mlx's own linears (a Transpose node a call) on the packed stream."""
    import mlx.nn as nn

    from engined.fastpath.transposed_linear import TransposedEmbedding, TransposedLinear

    if not engine.runner.flat:
        raise SystemExit("this model's family does not run on the 2-D stream")
    engine.runner.flat = False
    for _, module in engine.runner.model.named_modules():
        if type(module) in (TransposedLinear, TransposedEmbedding):
            module.__class__ = nn.Linear if type(module) is TransposedLinear else nn.Embedding


if __name__ == "__main__":
    main()
