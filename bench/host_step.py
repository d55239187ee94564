"""Host time per engine step: the Python that schedules a step and builds its graph, measured on the CPU.

On the H200 a c=64 decode step of an 8B model is host-bound (~15 ms of host
for ~5 ms of device, ``bench/gpu_serving_results.md``). This probe measures the
host part on the CPU: a random-weight model with Qwen3-8B's layer count and
attention layout (36 layers, 32 query heads, 8 KV heads, head_dim 128) but a
tiny hidden and MLP width and vocabulary, so the device work is small and the
graph is the same op for op; ``c`` requests decoding in the in-process Engine.

The attention route is the CUDA path's (``--backend cuda``): ``engined.kernels.gpu``
plans and prepares every launch as on the GPU, and only the kernel objects are
stand-ins (MLX builds no CUDA kernel without a CUDA back-end), each returning
lazy zeros of the launch's output shapes. The C++ cost of a real kernel call is
therefore not in these numbers; everything in Python above it is. On a CUDA
machine the real kernels run.
``--backend reference`` measures the pure-MLX route instead.

``--lora`` measures each level twice, the second time on an engine with
four random rank-16 adapters of every projection (``--max-loras 4``), the
requests spread over them round-robin, and prints the ratio: the host time
that LoRA's groups add to a step. The CUDA route's term kernel
(``engined.kernels.lora_term``) is a stand-in there too.

``--compile`` measures each level again on an engine whose decode steps are
replayed from compiled traces (``--compile-decode``, ``engined/fastpath/compiled_decode.py``)
and prints the ratios; a replayed step runs no layer's Python, so its layer and
attention timers stay at zero.

Per step it reports the host time (the step's wall time less the time spent
waiting for the device's tokens) and, in a second pass with timers around the
stages, where it goes: schedule, inputs and metadata, per-layer graph building
(the decoder layers, of which the attention modules), the sampling graph and
its launch, postprocess.

``--compare REV`` runs the probe on that git revision's engine code and on the
working tree's, in alternating subprocesses, and prints both and their ratio:

    python -m bench.host_step --compare main --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=36, intermediate_size=128,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=1024,
             rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192, tie_word_embeddings=False)
LORA_RANK = 16  # --lora's adapters


def _stand_in_kernels():
    """``engined.kernels.gpu._kernels`` for a machine without CUDA: callables taking a launch's arguments
    and returning lazy zeros of its output shapes, so the route runs up to the launch itself."""
    import mlx.core as mx

    def launch(inputs, output_shapes, output_dtypes, **_):
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

    def kernels(dialect, shared_bytes, min_groups=0):
        return launch, launch, launch

    return kernels


def _stand_in_term_kernel(*_group):
    """``engined.kernels.lora_term._kernel`` for a machine without CUDA: the base output's first columns,
    a view of the launch's output shape. Lazy zeros would free the graph of the base's matmul too."""

    def launch(inputs, output_shapes, **_):
        (rows, out), = output_shapes
        return [inputs[0][:rows, :out]]

    return launch


def _stand_in_qk_rope(*_shape):
    """``engined.kernels.qk_rope._kernel`` for a machine without CUDA: views of the projection's rows in the
    launch's output shapes (lazy zeros would free the projection's graph)."""

    def launch(inputs, output_shapes, **_):
        qkv, offset, outs = inputs[0], 0, []
        for shape in output_shapes:
            width = shape[1] * shape[2]
            outs.append(qkv[:, offset:offset + width].reshape(shape))
            offset += width
        return outs

    return launch


def build_engine(c: int, prompt_len: int, max_tokens: int, backend: str, async_scheduling: bool, seed: int,
                 adapters: list[Path] | None = None, compile_decode: bool = False):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from engined.engine import Engine
    from engined.loaders import LoadedModel
    from shared.config import EngineConfig

    if backend == "cuda" and not mx.cuda.is_available():
        from engined.kernels import gpu, lora_term, qk_rope

        gpu._kernels = _stand_in_kernels()
        lora_term._kernel = _stand_in_term_kernel
        qk_rope._kernel = _stand_in_qk_rope
    model_cls, args_cls = _get_classes(SHAPE)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(SHAPE))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    loaded = LoadedModel(model=model, model_id="random-qwen3-8b-layout", model_type="qwen3", tokenizer_dir=Path("."),
                         eos_token_ids=[], bos_token_id=None, context_length=8192, vocab_size=SHAPE["vocab_size"],
                         num_layers=SHAPE["num_hidden_layers"], num_kv_heads=SHAPE["num_key_value_heads"],
                         head_dim=SHAPE["head_dim"])
    blocks = c * (-(-(prompt_len + max_tokens) // 16) + 1) + 8
    # A small model length keeps the memory guard's warm-up prefill (one request that long) cheap on the CPU.
    cfg = EngineConfig(max_num_seqs=c, max_num_batched_tokens=2048, num_kv_blocks=blocks,
                       max_model_len=prompt_len + max_tokens + 16,
                       attention_backend=backend, async_scheduling=async_scheduling, compile_decode=compile_decode,
                       **(dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=LORA_RANK,
                               lora_modules=[f"a{k}={d}" for k, d in enumerate(adapters)]) if adapters else {}))
    return Engine(cfg, loaded=loaded)


def write_adapters(root: Path, seed: int) -> list[Path]:
    """Four random mlx_lm-format adapters of every projection of ``SHAPE``'s layers (bench.lora's)."""
    from mlx_lm.utils import _get_classes

    from bench.lora import write_adapters as write

    model_cls, args_cls = _get_classes(SHAPE)
    return write(model_cls(args_cls.from_dict(SHAPE)), root, LORA_RANK, seed=seed)


class Timers:
    """Seconds spent inside wrapped callables, by stage name; wrappers nest (a stage includes its inner ones)."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.undo: list = []

    def wrap(self, owner, name: str, stage: str) -> None:
        inner = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        fn = inner.__func__ if isinstance(inner, classmethod) else inner
        acc = self.s
        acc.setdefault(stage, 0.0)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[stage] += time.perf_counter() - t0

        setattr(owner, name, classmethod(timed) if isinstance(inner, classmethod) else timed)
        self.undo.append((owner, name, inner))

    def remove(self) -> None:
        for owner, name, inner in reversed(self.undo):
            setattr(owner, name, inner)
        self.undo = []


def host_stages(engine, t: Timers) -> None:
    """Timers around what ``host_s`` adds up: the step's host work, not its hand-off to MLX or its wait."""
    from engined.sampler import LaunchedStep

    t.wrap(engine.scheduler, "schedule", "schedule")
    t.wrap(engine, "_launch", "build")  # forward and sampling graphs
    t.wrap(LaunchedStep, "start", "launch")  # the hand-off: mx.async_eval
    t.wrap(engine, "_read_inflight", "read+after")  # the wait, then postprocess and output records
    t.wrap(LaunchedStep, "read", "read")
    t.wrap(engine.metrics, "on_step", "metrics")


def host_s(s: dict) -> float:
    """The host's part of the steps timed: scheduling, graph building, and the work after the tokens
    are read. On the CPU the launch runs much of the graph in the caller, and freeing a step's
    arrays returns its scratch (the K/V writes copy each layer's pool there): device work, not
    counted."""
    return s["schedule"] + s["build"] + s["read+after"] - s["read"] + s["metrics"]


def instrument(engine, t: Timers) -> None:
    """Timers inside the step's stages (nested in ``host_stages``' ones)."""
    import engined.runner as runner_mod
    from engined.model_layers import transformer_layers
    from engined.sampler import LaunchedStep

    runner = engine.runner
    t.wrap(engine.scheduler, "advance", "advance")
    t.wrap(engine.scheduler, "postprocess", "postprocess")
    t.wrap(engine, "_outputs", "outputs")
    t.wrap(runner.kv, "step_caches", "metadata")
    t.wrap(runner_mod, "forward_pooled", "forward")
    layers = transformer_layers(runner.model)
    t.wrap(type(layers[0]), "__call__", "layers")
    t.wrap(type(layers[0].self_attn), "__call__", "attention")
    t.wrap(LaunchedStep, "sample", "sample")
    if engine.lora is not None:
        from engined.lora.groups import ProjectionGroup
        from engined.lora.layers import LoraStep

        t.wrap(ProjectionGroup, "joined", "lora groups")  # inside the layers' (and attention's) stage
        t.wrap(LoraStep, "set", "lora set")


def measure(args) -> dict:
    """Each level's result, keyed by its concurrency ("64"; on the adapters "64 lora")."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(Path(tmp), args.seed) if args.lora else []
        for c in map(int, args.concurrency.split(",")):
            for lora in ([False, True] if adapters else [False]):
                out[f"{c} lora" if lora else str(c)] = measure_level(args, c, adapters if lora else None)
            if args.compile_decode:
                out[f"{c} compiled"] = measure_level(args, c, None, compile_decode=True)
    return out


def measure_level(args, c: int, adapters: list[Path] | None, compile_decode: bool = False) -> dict:
    """One engine's steps at ``c`` requests (on ``adapters``, round-robin, when given)."""
    import mlx.core as mx
    import numpy as np

    from shared.protocol import SamplingParams

    # The pool holds just what the run needs: on the CPU each K/V write copies its layer's pool.
    max_tokens = args.warmup + 2 * args.steps + 4
    engine = build_engine(c, args.prompt_len, max_tokens, args.backend, args.async_scheduling, args.seed, adapters,
                          compile_decode)
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(c):
        engine.add_request(f"r{i}", rng.integers(0, SHAPE["vocab_size"], args.prompt_len).tolist(), params,
                           lora_name=f"a{i % len(adapters)}" if adapters else None)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(args.warmup):
        engine.step()

    def timed_steps(n, timers):
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        wall = time.perf_counter() - t0
        timers.remove()
        return wall

    n, layers = args.steps, SHAPE["num_hidden_layers"]
    base = Timers()
    host_stages(engine, base)
    wall = timed_steps(n, base)
    timers = Timers()
    host_stages(engine, timers)
    instrument(engine, timers)
    timed_steps(n, timers)
    stages = {k: 1e3 * v / n for k, v in timers.s.items()}
    result = dict(
        host_ms=1e3 * host_s(base.s) / n, wall_ms=1e3 * wall / n, launch_ms=1e3 * base.s["launch"] / n,
        instrumented_host_ms=1e3 * host_s(timers.s) / n,
        stages_ms={k: round(v, 3) for k, v in stages.items()},
        layer_us=1e3 * stages["layers"] / layers, attention_us=1e3 * stages["attention"] / layers,
    )
    engine.abort(list(engine.requests))
    while engine.has_unfinished():
        engine.step()
    del engine
    mx.clear_cache()
    return result


def compare(args) -> None:
    """The probe on ``args.compare``'s code and on the working tree's, alternating, in subprocesses."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(root), "archive", args.compare], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        trees = {args.compare: base, "tree": root}
        # Every argument but --compare and --rounds with their values (a value alone may equal another's).
        argv, worker = sys.argv[1:], []
        i = 0
        while i < len(argv):
            if argv[i] in ("--compare", "--rounds"):
                i += 2
                continue
            worker.append(argv[i])
            i += 1
        runs: dict[str, list[dict]] = {k: [] for k in trees}
        for rnd in range(args.rounds):
            names = list(trees) if rnd % 2 == 0 else list(trees)[::-1]  # each goes first in turn
            for name in names:
                res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json", *worker],
                                     cwd=trees[name], env={"PYTHONPATH": str(trees[name]), "PATH": "/usr/bin:/bin"},
                                     check=True, capture_output=True, text=True)
                runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
                print(f"round {rnd} {name}: " + ", ".join(
                    f"c={c} host {r['host_ms']:.2f} ms, attention {r['attention_us']:.1f} us/layer"
                    for c, r in runs[name][-1].items()), flush=True)
    print()
    print("| c | code | host ms/step | decoder layer us | attention us | " +
          " | ".join(runs["tree"][0][next(iter(runs["tree"][0]))]["stages_ms"]) + " |")
    for c in runs["tree"][0]:
        med = {}
        for name in trees:
            rows = [r[c] for r in runs[name]]
            med[name] = {k: statistics.median(r[k] for r in rows) for k in ("host_ms", "layer_us", "attention_us")}
            stages = {k: statistics.median(r["stages_ms"][k] for r in rows) for k in rows[0]["stages_ms"]}
            print(f"| {c} | {name} | {med[name]['host_ms']:.2f} | {med[name]['layer_us']:.1f} | "
                  f"{med[name]['attention_us']:.1f} | " + " | ".join(f"{v:.2f}" for v in stages.values()) + " |")
        a, b = med[args.compare], med["tree"]
        print(f"| {c} | ratio | {a['host_ms'] / b['host_ms']:.2f}x | {a['layer_us'] / b['layer_us']:.2f}x | "
              f"{a['attention_us'] / b['attention_us']:.2f}x | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="64,16")
    p.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--async", dest="async_scheduling", action="store_true",
                   help="asynchronous steps, as on a GPU (default: synchronous, so that the CPU's device "
                        "work never runs while the host builds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", action="store_true", help="each level again on 4 adapters (rank 16, every projection)")
    p.add_argument("--compile", dest="compile_decode", action="store_true",
                   help="each level again with decode steps replayed from compiled graphs (--compile-decode)")
    p.add_argument("--json", action="store_true", help="one JSON line (what --compare reads)")
    p.add_argument("--compare", metavar="REV", help="also run git revision REV's code, alternating")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.compare:
        compare(args)
        return
    print(f"seed {args.seed}", file=sys.stderr)
    res = measure(args)
    if args.json:
        print(json.dumps(res))
        return
    for c, r in res.items():
        print(f"c={c}: host {r['host_ms']:.2f} ms/step (wall {r['wall_ms']:.2f}, launch {r['launch_ms']:.2f}; "
              f"{r['instrumented_host_ms']:.2f} "
              f"with timers), decoder layer {r['layer_us']:.1f} us, attention {r['attention_us']:.1f} us")
        print("   stages ms/step: " + ", ".join(f"{k} {v:.2f}" for k, v in r["stages_ms"].items()))
        if c.endswith((" lora", " compiled")):
            plain = res[c.split()[0]]
            # The passes with timers: on the CPU the other pass's host column can take device work.
            host = r["instrumented_host_ms"] / plain["instrumented_host_ms"]
            if c.endswith(" compiled"):  # replayed steps run no layer's Python, so no layer timer fires
                print(f"   compiled against built: host {r['host_ms'] / plain['host_ms']:.2f}x, with timers "
                      f"{host:.2f}x, forward {r['stages_ms']['forward'] / plain['stages_ms']['forward']:.2f}x")
            else:
                print(f"   4 adapters against the base: host with timers {host:.2f}x, "
                      f"decoder layer {r['layer_us'] / plain['layer_us']:.2f}x")


if __name__ == "__main__":
    main()
