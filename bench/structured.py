"""Constrained decoding overhead: decode step time of 16 constrained requests against 16 plain ones.

Both batches decode the same prompts for the same number of tokens; only
steps where all 16 requests are decoding count (so the prompts' prefills,
served from the prefix cache after the first run, are not timed). The constrained requests
follow a JSON schema whose one long string keeps every matcher alive for the
whole run. A second measurement adds a request with a slow-to-compile grammar
(a 20000-value enum) to 16 decoding plain requests and reports the slowest
step while it compiles against the median step: compilation runs on worker
threads and must not stall the step loop. That request's prompt is one of its
own, so its prefill, inside the steps while it compiles, is not a cache hit.

    python -m bench.structured [--max-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mlxd.engined.device import load_fast_blas

# A benchmark script, run as __main__: the fast BLAS before the imports below load mlx.core.
load_fast_blas()
from transformers import AutoTokenizer  # noqa: E402

from mlxd.engined.engine import Engine
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams, StructuredSpec

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 800}},
          "required": ["story"], "additionalProperties": False}
SLOW = {"enum": [f"value-{i}-" + "x" * (i % 13) for i in range(20000)]}
N = 16


def decode_steps(engine: Engine, prompts, params, tag: str) -> list[float]:
    """Seconds per step over the steps where every request is decoding."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    reqs = [engine.requests[r] for r in ids]
    times, finished = [], 0
    while finished < len(ids):
        decoding = all(r.num_output_tokens >= 1 and not r.finished for r in reqs)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        finished += sum(1 for o in outs if o.finish_reason)
        if decoding and all(not r.finished for r in reqs):
            times.append(dt)
    return times


def compile_stall(engine: Engine, prompts, slow_prompt, max_tokens: int) -> tuple[float, float, float, int]:
    """(median step, slowest step while a big grammar compiles, compile seconds, the slow request's prompt
    tokens found in the prefix cache). ``slow_prompt`` is one no earlier run sent: its prefill, all but the
    chat template's opening that every prompt shares, runs while the grammar compiles, as a new user's would."""
    plain = SamplingParams(max_tokens=max_tokens * 2, temperature=0.0, ignore_eos=True)
    ids = [f"stall-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, plain)
    while any(engine.requests[r].num_output_tokens < 2 for r in ids):
        engine.step()
    engine.add_request("slow", slow_prompt, SamplingParams(
        max_tokens=8, temperature=0.0, structured=StructuredSpec("json_schema", json.dumps(SLOW))))
    slow = engine.requests["slow"]
    grammar = slow.grammar
    t_add = time.perf_counter()
    during, after, compiled_at = [], [], None
    while engine.has_unfinished():
        compiling = not grammar.future.done()
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        # A step that began while the grammar compiled overlapped the compilation.
        (during if compiling else after).append(dt)
        if compiled_at is None and grammar.future.done():
            compiled_at = time.perf_counter() - t_add
    return statistics.median(after), max(during) if during else 0.0, compiled_at or 0.0, slow.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engine = Engine(EngineConfig(num_kv_blocks=1024, max_num_seqs=N + 1, max_num_batched_tokens=1024))
    tok = AutoTokenizer.from_pretrained(engine.info.tokenizer_dir)
    prompts = []
    for i in range(N + 1):  # the last one for compile_stall's slow request alone
        ids = tok.apply_chat_template([{"role": "user", "content": f"Tell story number {i} as JSON."}],
                                      add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    prompts, slow_prompt = prompts[:N], prompts[N]
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True, seed=1)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1,
                                 structured=StructuredSpec("json_schema", json.dumps(SCHEMA)))
    decode_steps(engine, prompts, constrained, "warm")  # builds the llguidance tokenizer, compiles the schema
    p_times, c_times = [], []
    for r in range(args.repeats):
        p_times += decode_steps(engine, prompts, plain, f"p{r}")
        c_times += decode_steps(engine, prompts, constrained, f"c{r}")
    p_med, c_med = statistics.median(p_times), statistics.median(c_times)
    median, worst, compile_s, slow_cached = compile_stall(engine, prompts, slow_prompt, args.max_tokens)
    print(json.dumps({
        "requests": N, "max_tokens": args.max_tokens,
        "plain_step_ms": round(p_med * 1e3, 2), "constrained_step_ms": round(c_med * 1e3, 2),
        "ratio": round(c_med / p_med, 3), "steps_counted": [len(p_times), len(c_times)],
        "compile_s": round(compile_s, 3), "median_step_ms": round(median * 1e3, 2),
        "slowest_step_while_compiling_ms": round(worst * 1e3, 2), "slow_request_cached_tokens": slow_cached,
    }))


if __name__ == "__main__":
    main()
