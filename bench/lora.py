"""LoRA throughput: one batch spread over 4 adapters against the same batch on the base model.

In-process engines on the same model (default: the embedded SmolLM2-135M),
same prompts, greedy, every request ``--max-tokens`` long. Three systems:

- ``base``: an engine without LoRA, every request on the base model;
- ``4 adapters``: an engine with ``--enable-lora --max-loras 4``, the requests
  spread round-robin over four random rank-``--rank`` adapters of every
  attention and MLP projection (of the ``--targets`` only, when given; one
  packed step mixes them all);
- ``lora on, base requests``: the LoRA engine with requests naming no adapter
  (what enabling LoRA costs requests that use none).

Each level runs each system once as warm-up, then ``--repeats`` times,
alternating; reports generated tokens/s (median) and the ratio to ``base``,
and the whole runs' two phases: the time until every request has its first
token (the prefill), then the milliseconds a step.
Then one decode step of ``c`` rows (every prefill done) is forwarded
``--step-repeats`` times with its rows' adapters, as many times with every
row on the base, and the same prompts' step as many times on the engine
without LoRA, alternating step by step: the LoRA term's own cost and what
enabling LoRA costs every row, with far less of a busy machine's noise than
whole runs.
``--shape llama-8b`` runs a model of Llama-3.1-8B's shape with random bf16
weights instead (no download; both engines share the same arrays), for a GPU.
``--term`` times only the LoRA term of one projection of the shape (its
q_proj's and gate_proj's sizes): the layers' two dense matmuls over every
slot's A and B with each row's other slots' columns masked to zero, against
``gather_mm`` of each row's own slot (what vLLM's punica kernels do), beside
the base matmul; then q/k/v's and gate/up's terms taken apart against one
shared x·A (what the layers do), and on CUDA the term kernel's forms (plain, with the MLP's activation, with
the block's residual) checked against MLX's operations: seconds, not minutes, on a GPU.
``--prefill`` times one prefill chunk's forward (no adapter) on both engines,
then each projection kind over every layer in each engine's form. ``--trace``
prints every timed run's prefill steps (ms, tokens, ms waiting for the device,
rows read) and its decode phase's ms a step; ``--profile N`` runs each system once more under cProfile and
prints its N costliest functions.

    python -m bench.lora [--model PATH | --shape NAME] [--levels 8 64] [--max-tokens 32] [--rank 16]
                         [--prompt-lens 32 256] [--targets q_proj v_proj] [--term] [--prefill] [--clear-cache]
                         [--cache-limit GIB] [--trace] [--profile N]

Over 400 lines because the whole runs, the one-step comparison, the term's forms and the prefill
timing all build the same three engines over one set of arrays and adapters.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from mlxd.engined.device import load_fast_blas

# A benchmark script, run as __main__: the fast BLAS before the imports below load mlx.core.
load_fast_blas()
import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu

from mlxd.bench.kernels.on_cuda import alternating_ms
from mlxd.engined.engine import Engine
from mlxd.engined.kernels import lora_term
from mlxd.engined.loaders import load_model
from mlxd.engined.lora.layers import install
from mlxd.engined.model_layers import transformer_layers
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams

NUM_ADAPTERS = 4
SHAPES = {
    "llama-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                     rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False),
    # The embedded model's shape (the CPU runs' default model), for --term on a CPU.
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    # The script end to end in seconds on a CPU.
    "llama-tiny": dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=False),
}


def random_model_maker(name: str):
    """A maker of LoadedModels of shape ``name`` whose models all share one set of random bf16 arrays."""
    from mlx_lm.utils import _get_classes

    from mlxd.engined.loaders import LoadedModel

    shape = SHAPES[name]
    model_cls, args_cls = _get_classes(shape)
    mx.random.seed(0)

    def fresh():
        m = model_cls(args_cls.from_dict(shape))
        m.set_dtype(mx.bfloat16)
        return m

    first = fresh()
    mx.eval(first.parameters())

    def make():
        m = fresh()
        m.update(first.parameters())  # the same arrays; its own random ones are never evaluated
        return LoadedModel(model=m, model_id=f"random-{name}", model_type=shape["model_type"],
                           tokenizer_dir=Path("."), eos_token_ids=[], bos_token_id=None, context_length=8192,
                           vocab_size=shape["vocab_size"], num_layers=shape["num_hidden_layers"],
                           num_kv_heads=shape["num_key_value_heads"],
                           head_dim=shape["hidden_size"] // shape["num_attention_heads"])

    return make


def write_adapters(model, root: Path, rank: int, targets: list[str] | None = None, seed: int = 0) -> list[Path]:
    """``NUM_ADAPTERS`` random mlx_lm-format adapters of every linear projection of the model's layers (of those
    whose names end in one of ``targets``, when given)."""
    _, projections = install(model, 1, 1, mx.float32)  # only to list the projections and their sizes
    rng = np.random.default_rng(seed)
    dirs = []
    for k in range(NUM_ADAPTERS):
        tensors = {}
        for path, (wrapper, proj) in projections.items():
            if proj is not None or (targets and not path.endswith(tuple(targets))):
                continue  # experts: this benchmark's models are dense
            tensors[f"{path}.lora_a"] = mx.array(rng.normal(0, 0.02, (wrapper.input_dims, rank)).astype(np.float32))
            tensors[f"{path}.lora_b"] = mx.array(rng.normal(0, 0.02, (rank, wrapper.output_dims)).astype(np.float32))
        d = root / f"adapter{k}"
        d.mkdir()
        mx.save_safetensors(str(d / "adapters.safetensors"), tensors)
        (d / "adapter_config.json").write_text(json.dumps(
            {"fine_tune_type": "lora", "lora_parameters": {"rank": rank, "scale": 1.0, "dropout": 0.0}}))
        dirs.append(d)
    return dirs


def timed_run(engine: Engine, prompts: list[list[int]], params: SamplingParams, loras: list[str] | None,
              trace: list | None = None) -> tuple[float, float, int, float]:
    """``Engine.generate`` of ``prompts`` in two phases: seconds until every request has its first token (the
    prefill), then seconds and steps until every one has finished (the decode), and the decode's seconds spent
    waiting for the device (the rest is the host's). ``trace`` gets the prefill's steps: (ms, tokens computed,
    ms waiting for the device, rows the step read)."""
    ids = [f"run-{i}" for i in range(len(prompts))]
    for rid, prompt, lora in zip(ids, prompts, loras or [None] * len(prompts)):
        engine.add_request(rid, prompt, params, lora_name=lora)
    reqs = [engine.requests[rid] for rid in ids]
    started, finished = set(), set()
    start = time.perf_counter()
    first = steps = 0
    wait = engine.sync_wait_s
    while len(finished) < len(ids):
        if trace is not None and not first:  # the prefill's steps only: the decode's are timed bare
            t0, wait0, computed0 = time.perf_counter(), engine.sync_wait_s, sum(r.num_computed_tokens for r in reqs)
        outs = engine.step()
        for out in outs:
            started.add(out.request_id)
            if out.finish_reason:
                finished.add(out.request_id)
        if first:
            steps += 1
            continue
        if trace is not None:
            trace.append(((time.perf_counter() - t0) * 1e3, sum(r.num_computed_tokens for r in reqs) - computed0,
                          (engine.sync_wait_s - wait0) * 1e3, len(outs)))
        if len(started) == len(ids):
            first, wait = time.perf_counter(), engine.sync_wait_s
    return first - start, time.perf_counter() - first, max(1, steps), engine.sync_wait_s - wait


def _decode_batch(engine: Engine, prompts: list[list[int]], loras: list[str] | None, ids: list[str]):
    """``engine``'s next batch once every one of ``prompts`` has its first token: one decode row each."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)  # room for the step measured
    for rid, prompt, lora in zip(ids, prompts, loras or [None] * len(prompts)):
        engine.add_request(rid, prompt, params, lora_name=lora)
    reqs = [engine.requests[rid] for rid in ids]
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    batch = engine.scheduler.schedule()
    assert len(batch.scheduled) == len(prompts) and all(n == 1 for _, n in batch.scheduled)
    return batch


def step_cost(engine: Engine, base: Engine, prompts: list[list[int]], loras: list[str], repeats: int
              ) -> dict[str, float]:
    """Median seconds of one packed decode step's forward: rows on their adapters, the same rows on the base,
    and the same prompts' step on the engine without LoRA (``base``)."""
    ids = [f"step-{i}" for i in range(len(prompts))]
    batch, plain = _decode_batch(engine, prompts, loras, ids), _decode_batch(base, prompts, None, ids)
    slots = [r.lora_slot for r, _ in batch.scheduled]

    def timed(adapters: bool) -> float:
        for (r, _), slot in zip(batch.scheduled, slots):
            r.lora_slot = slot if adapters else 0
        start = time.perf_counter()
        mx.eval(engine.runner.run(batch))
        return time.perf_counter() - start

    def timed_plain() -> float:
        start = time.perf_counter()
        mx.eval(base.runner.run(plain))
        return time.perf_counter() - start

    runs = {"adapters": lambda: timed(True), "base": lambda: timed(False), "no lora": timed_plain}
    times = {k: [] for k in runs}
    for i in range(repeats + 1):
        for k, run in runs.items():
            t = run()
            if i:
                times[k].append(t)
    for (r, _), slot in zip(batch.scheduled, slots):
        r.lora_slot = slot
    for e in (engine, base):
        e.abort(ids)
        e.step()
    return {k: statistics.median(t) for k, t in times.items()}


def prefill_cost(lora: Engine, base: Engine, prompts: list[list[int]], repeats: int) -> None:
    """Median milliseconds of one prefill chunk's forward (the first batch of ``prompts``, no adapter) on the
    engine without LoRA and on the LoRA engine, then of each projection kind over every layer on that many
    rows, in each engine's form: where a base engine's prefill loses to the LoRA engine's."""
    ids = [f"prefill-{i}" for i in range(len(prompts))]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    batches = {}
    for name, engine in (("no lora", base), ("lora", lora)):
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        batches[name] = (engine, engine.scheduler.schedule())
    rows = sum(n for _, n in batches["no lora"][1].scheduled)
    runs = {name: (lambda e=e, b=b: e.runner.run(b)) for name, (e, b) in batches.items()}
    ms = alternating_ms(runs, repeats)
    print(f"one prefill chunk of {rows} tokens: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()), flush=True)
    x = mx.random.normal((rows, base.runner.model.args.hidden_size)).astype(mx.bfloat16)
    wide = mx.random.normal((rows, base.runner.model.args.intermediate_size)).astype(mx.bfloat16)
    mx.eval(x, wide)
    for kind in ("q/k/v", "o", "gate/up", "down"):
        runs = {}
        for name, (engine, _) in batches.items():
            layers = transformer_layers(engine.runner.model)
            if kind == "q/k/v":
                runs[name] = lambda ls=layers: [getattr(l.self_attn, p)(x) for l in ls
                                                for p in ("qkv_proj", "q_proj", "k_proj", "v_proj")
                                                if p in l.self_attn]
            elif kind == "o":
                runs[name] = lambda ls=layers: [l.self_attn.o_proj(x) for l in ls]
            elif kind == "gate/up":
                runs[name] = lambda ls=layers: [f(x) for l in ls for f in (l.mlp.gate_proj, l.mlp.up_proj)]
            else:
                runs[name] = lambda ls=layers: [l.mlp.down_proj(wide) for l in ls]
        ms = alternating_ms(runs, repeats)
        print(f"  {kind} of every layer on {rows} rows: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()),
              flush=True)
    for engine, _ in batches.values():
        engine.abort(ids)
        engine.step()


def _alternate(runs: dict, repeats: int) -> dict[str, float]:
    """Median microseconds of each of ``runs`` (``bench.kernels.on_cuda.alternating_ms``)."""
    return {k: ms * 1e3 for k, ms in alternating_ms(runs, repeats).items()}


def term_cost(shape: str, rank: int, repeats: int) -> None:
    """One projection's LoRA term alone, rows spread round-robin over 4 adapters; then the projections that
    read one input (q/k/v, gate/up), apart against joined as one group (base and term)."""
    dims = SHAPES[shape]
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16  # MLX's CPU gather_mm: float32 only

    def masks(rows: int) -> tuple[mx.array, mx.array]:
        """Each row's slot (1..4, round-robin; 0 is the base in gather_mm's stacks) and its dense mask."""
        spread = np.arange(rows) % NUM_ADAPTERS + 1
        mask = np.repeat(np.eye(NUM_ADAPTERS + 1)[spread][:, 1:], rank, axis=1)
        return mx.array(spread.astype(np.uint32)), mx.array(mask).astype(dtype)

    print("\n| projection (in x out) | rows | base matmul (us) | + term, gather_mm (us) | + term, dense masked (us) |")
    print("|---|---|---|---|---|")
    for d_in, d_out in ((dims["hidden_size"], dims["hidden_size"]), (dims["hidden_size"], dims["intermediate_size"])):
        w = mx.random.normal((d_out, d_in)).astype(dtype) * 0.02
        a = mx.random.normal((NUM_ADAPTERS + 1, d_in, rank)).astype(dtype) * 0.02
        b = mx.random.normal((NUM_ADAPTERS + 1, rank, d_out)).astype(dtype) * 0.02
        # The layers' layout: x @ [A_1 .. A_S] -> [rows, S * rank], masked, @ [B_1; ..; B_S], added by addmm.
        a_all = a[1:].transpose(1, 0, 2).reshape(d_in, -1)
        b_all = b[1:].reshape(-1, d_out)
        for rows in (8, 64, 512):
            x = mx.random.normal((rows, d_in)).astype(dtype)
            slot, mask = masks(rows)
            mx.eval(w, a, b, x, slot, mask, a_all, b_all)

            def gathered():
                h = mx.gather_mm(x[:, None], a, rhs_indices=slot)
                return x @ w.T + mx.gather_mm(h, b, rhs_indices=slot).squeeze(1)

            runs = {
                "base": lambda: x @ w.T,
                "gather": gathered,
                "dense": lambda: mx.addmm(x @ w.T, (x @ a_all) * mask, b_all),
            }
            us = _alternate(runs, repeats)
            print(f"| {d_in} x {d_out} | {rows} | {us['base']:.0f} | {us['gather']:.0f} | {us['dense']:.0f} |",
                  flush=True)
    hidden, kv = dims["hidden_size"], dims["hidden_size"] * dims["num_key_value_heads"] // dims["num_attention_heads"]
    print("\n| projections (in x outs) | rows | base matmuls apart (us) | joined base (us) | + terms apart (us) "
          "| joined, + one term (us) | same, x·A folded into the base (us) | folded, term added to the whole (us) "
          "| folded, term kernel (us) | kernel's largest error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cuda = mx.cuda.is_available()
    for outs in ((hidden, kv, kv), (dims["intermediate_size"],) * 2):
        width = len(outs) * rank  # the group's columns per slot (engined/lora/groups.py)
        ws = [mx.random.normal((o, hidden)).astype(dtype) * 0.02 for o in outs]
        w_cat = mx.concatenate(ws, axis=0)
        a_s = [mx.random.normal((hidden, NUM_ADAPTERS * rank)).astype(dtype) * 0.02 for _ in outs]
        b_s = [mx.random.normal((NUM_ADAPTERS * rank, o)).astype(dtype) * 0.02 for o in outs]
        a_cat = mx.random.normal((hidden, NUM_ADAPTERS * width)).astype(dtype) * 0.02
        b_cat = mx.random.normal((NUM_ADAPTERS * width, sum(outs))).astype(dtype) * 0.02  # block-diagonal there
        w_ext, out = mx.concatenate([w_cat, a_cat.T]), sum(outs)  # A's columns as the base's last output rows
        # B with zero columns for x·A's, so that addmm's addend is the whole base output, not a slice of it.
        b_ext = mx.concatenate([b_cat, mx.zeros((b_cat.shape[0], a_cat.shape[1]), dtype)], axis=1)
        for rows in (8, 64, 512):
            x = mx.random.normal((rows, hidden)).astype(dtype)
            slots, mask = masks(rows)
            group_mask = mx.repeat(mask[:, ::rank], width, axis=1)
            mx.eval(ws, w_cat, a_s, b_s, a_cat, b_cat, w_ext, b_ext, x, mask, group_mask)

            def folded():
                y = x @ w_ext.T
                return mx.addmm(y[:, :out], y[:, out:] * group_mask, b_cat)

            def whole():
                z = x @ w_ext.T
                return mx.addmm(z, z[:, out:] * group_mask, b_ext)[:, :out]

            def kernel():
                z = x @ w_ext.T
                return lora_term.add_term(z, z, out, b_ext, slots, width, out)

            runs = {
                "base": lambda: [x @ w.T for w in ws],
                "joined": lambda: x @ w_cat.T,
                "apart": lambda: [mx.addmm(x @ w.T, (x @ ai) * mask, bi) for w, ai, bi in zip(ws, a_s, b_s)],
                "group": lambda: mx.addmm(x @ w_cat.T, (x @ a_cat) * group_mask, b_cat),
                "folded": folded,
                "whole": whole,
            }
            err = "-"
            if cuda:  # the engine's form on CUDA (engined/kernels/lora_term.py), checked against MLX's
                runs["kernel"] = kernel
                # Checked with every fifth row on the base (slot 0: no term) among the adapters' rows.
                on_base = mx.array(np.arange(rows) % 5 == 0)
                z = x @ w_ext.T
                want = mx.addmm(z, z[:, out:] * (group_mask * ~on_base[:, None]), b_ext)[:, :out]
                on_slots = mx.where(on_base, 0, slots).astype(mx.uint32)
                got = lora_term.add_term(z, z, out, b_ext, on_slots, width, out)
                err = _relative_error(got, want)
                if len(outs) == 2:  # gate/up: the kernel that also applies the MLP's activation
                    half = outs[0]
                    got = lora_term.add_term(z, z, out, b_ext, on_slots, width, half, glu=True)
                    err += f", with the activation {_relative_error(got, swiglu(want[:, :half], want[:, half:]))}"
                else:  # the kernel that also adds the block's residual (an o_proj's and down_proj's form)
                    residual = mx.random.normal((rows, out)).astype(dtype)
                    got = lora_term.add_term(z, z, out, b_ext, on_slots, width, out, residual=residual)
                    err += f", with a residual {_relative_error(got, residual + want)}"
            us = _alternate(runs, repeats)
            print(f"| {hidden} x {'+'.join(map(str, outs))} | {rows} | {us['base']:.0f} | {us['joined']:.0f} "
                  f"| {us['apart']:.0f} | {us['group']:.0f} | {us['folded']:.0f} | {us['whole']:.0f} "
                  f"| {us.get('kernel', float('nan')):.0f} | {err} |", flush=True)


def _relative_error(got: mx.array, want: mx.array) -> str:
    """The largest difference relative to the largest value."""
    want = want.astype(mx.float32)
    return f"{(mx.abs(got.astype(mx.float32) - want).max() / mx.abs(want).max()).item():.1e}"


def make_prompts(n: int, vocab: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, size=int(k)).tolist()
            for k in rng.integers(lengths[0], lengths[1] + 1, size=n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--levels", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--repeats", type=int, default=2, help="timed whole runs per system (0: the step alone)")
    ap.add_argument("--step-repeats", type=int, default=10)
    ap.add_argument("--targets", nargs="+", default=None, metavar="NAME",
                    help="adapt only the projections so named (PEFT's common: q_proj v_proj); default all")
    ap.add_argument("--term", action="store_true", help="time one projection's LoRA term only (of --shape)")
    ap.add_argument("--no-async", action="store_true",
                    help="engines without asynchronous scheduling (a step's host and device time add up)")
    ap.add_argument("--prefill", action="store_true",
                    help="time one prefill chunk's forward and each projection kind on both engines, then stop")
    ap.add_argument("--trace", action="store_true", help="print every timed run's prefill steps")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed runs, one more run of each system under cProfile: its N costliest functions")
    ap.add_argument("--cache-limit", type=float, default=None, metavar="GIB",
                    help="MLX's buffer-cache limit once both engines are built (default: what their memory guard set)")
    ap.add_argument("--clear-cache", action="store_true",
                    help="empty MLX's buffer cache before every timed run (no run reuses another's buffers)")
    args = ap.parse_args()
    if args.term:
        return term_cost(args.shape or "llama-8b", args.rank, args.step_repeats)

    top = max(args.levels)
    common = dict(max_num_seqs=top, max_num_batched_tokens=2048, enable_prefix_caching=False,
                  async_scheduling=False if args.no_async else None,
                  num_kv_blocks=top * (args.prompt_lens[1] + args.max_tokens) // 16 + 2 * top)
    make = random_model_maker(args.shape) if args.shape else (lambda: load_model(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(make().model, Path(tmp), args.rank, args.targets)
        base = Engine(EngineConfig(model=args.model, **common), make())
        lora = Engine(EngineConfig(model=args.model, enable_lora=True, max_loras=NUM_ADAPTERS,
                                   max_lora_rank=args.rank,
                                   lora_modules=[f"a{k}={d}" for k, d in enumerate(adapters)], **common), make())
        if args.cache_limit is not None:
            mx.set_cache_limit(int(args.cache_limit * 2**30))
        print(f"device {mx.default_device()}, model {base.info.model_id}, rank {args.rank}, "
              f"{NUM_ADAPTERS} adapters of {' '.join(args.targets or ['every projection'])}, "
              f"slots {lora.lora.nbytes / 2**20:.1f} MiB", flush=True)
        if args.prefill:
            return prefill_cost(lora, base, make_prompts(top, base.info.vocab_size, top, tuple(args.prompt_lens)),
                                args.step_repeats)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        rows, steps = [], []
        for level in args.levels:
            prompts = make_prompts(level, base.info.vocab_size, level, tuple(args.prompt_lens))
            spread = [f"a{i % NUM_ADAPTERS}" for i in range(level)]
            systems = {"base": (base, None), "4 adapters": (lora, spread), "lora on, base requests": (lora, None)}
            if not args.repeats:  # the step measurement alone
                systems = {}
            for name, (engine, loras) in list(systems.items()):
                try:
                    engine.generate(prompts, params, loras)  # warm-up
                except Exception as e:  # report what broke and keep the others' numbers
                    print(f"c={level}: {name} failed: {type(e).__name__}: {e}", flush=True)
                    del systems[name]
            times = {name: [] for name in systems}
            phases = {name: [] for name in systems}
            order = list(systems)
            for i in range(args.repeats):  # alternating, so that background load falls on all alike,
                for name in order[i % len(order):] + order[:i % len(order)]:  # each system first in turn
                    engine, loras = systems[name]
                    if args.clear_cache:
                        mx.clear_cache()
                    start, trace = time.perf_counter(), []
                    phases[name].append(timed_run(engine, prompts, params, loras, trace))
                    times[name].append(time.perf_counter() - start)
                    if args.trace:
                        _, decode_s, decode_steps, _ = phases[name][-1]
                        print(f"c={level} {name}, run {i}: the prefill's steps (ms / tokens / ms waiting / rows "
                              "read): " + "  ".join(f"{ms:.1f}/{n}/{w:.1f}/{r}" for ms, n, w, r in trace)
                              + f"; then {decode_s / decode_steps * 1e3:.2f} ms a decode step", flush=True)
            if args.profile:
                for name, (engine, loras) in systems.items():
                    print(f"c={level} {name}: one more whole run under cProfile (not timed), the functions that "
                          "took the most time of their own:", flush=True)
                    profile = cProfile.Profile()
                    profile.runcall(timed_run, engine, prompts, params, loras)
                    pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
            tokens = level * args.max_tokens
            rate = {name: tokens / statistics.median(t) for name, t in times.items()}
            if "base" in rate:
                # The decode phase's milliseconds a step: the whole run's ratio also carries the prefill's.
                decode = {n: statistics.median(p[1] / p[2] for p in ph) * 1e3 for n, ph in phases.items()}
                rows.append((level, rate, decode))
                print(f"c={level}: " + "   ".join(f"{n} {r:.1f} tok/s ({r / rate['base']:.2f}x)"
                                                 for n, r in rate.items()), flush=True)
                print(f"c={level}: whole runs' phases (median ms): " + "   ".join(
                    f"{n}: until every first token {statistics.median(p[0] for p in ph) * 1e3:.1f}, then "
                    f"{decode[n]:.2f} a step ({statistics.median(p[3] / p[2] for p in ph) * 1e3:.2f} of it waiting "
                    "for the device)" for n, ph in phases.items()), flush=True)
            if args.step_repeats:
                t = step_cost(lora, base, prompts, spread, args.step_repeats)
                steps.append((level, t))
                print(f"c={level}: one decode step's forward: {t['adapters'] * 1e3:.1f} ms on 4 adapters"
                      f", {t['base'] * 1e3:.1f} ms on the base ({t['base'] / t['adapters']:.2f}x), "
                      f"{t['no lora'] * 1e3:.1f} ms on the engine without LoRA "
                      f"({t['no lora'] / t['adapters']:.2f}x)", flush=True)
    print("\n| concurrent requests | base tok/s | 4 adapters tok/s | ratio | LoRA on, base requests tok/s | ratio "
          "| decode ms a step, base / 4 adapters / LoRA on, base requests | decode ratio, 4 adapters |")
    print("|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for level, r, d in rows:
        b = r.get("base", nan)
        a, o = r.get("4 adapters", nan), r.get("lora on, base requests", nan)
        db, da, do = d.get("base", nan), d.get("4 adapters", nan), d.get("lora on, base requests", nan)
        print(f"| {level} | {b:.1f} | {a:.1f} | {a / b:.2f}x | {o:.1f} | {o / b:.2f}x "
              f"| {db:.2f} / {da:.2f} / {do:.2f} | {db / da:.2f}x |")
    if steps:
        print("\n| concurrent requests | decode step, 4 adapters (ms) | same step, base rows (ms) | ratio "
              "| engine without LoRA (ms) | ratio |")
        print("|---|---|---|---|---|---|")
        for level, t in steps:
            print(f"| {level} | {t['adapters'] * 1e3:.1f} | {t['base'] * 1e3:.1f} "
                  f"| {t['base'] / t['adapters']:.2f}x | {t['no lora'] * 1e3:.1f} "
                  f"| {t['no lora'] / t['adapters']:.2f}x |")


if __name__ == "__main__":
    main()
