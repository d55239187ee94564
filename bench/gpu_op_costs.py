"""What one operation of a decode step costs the host on a GPU, by kind, and how many of each a step has.

A decode step at c = 64 on an H200 is bound by the host (bench/gpu_serving_results.md):
most of it inside ``mx.async_eval``, where MLX encodes each operation of the
graph. This probe splits that cost by operation kind:

- **census**: an 8B-shaped engine (random weights, bf16) at ``--c`` requests
  decoding, synchronous steps; one step's graph is written out with
  ``mx.export_to_dot`` as it is handed to ``mx.async_eval`` and its nodes counted
  by primitive.
- **costs**: chains of ``--n`` operations of one kind on a decode step's shapes
  (each op's input the previous op's output, so none can be skipped), timed as
  Python building the chain, ``mx.async_eval`` encoding it, and the wait for
  the device; reported per operation.

    python -m bench.gpu_op_costs [--c 64] [--n 400]
"""

from __future__ import annotations

import argparse
import collections
import re
import time


def census(args) -> None:
    import mlx.core as mx

    from bench.gpu_serving import build_models, engine_for
    from shared.protocol import SamplingParams

    _, make_loaded, _ = build_models(args.model, "bf16", 0)
    engine = engine_for(make_loaded, args, args.c, False)
    params = SamplingParams(max_tokens=args.steps + 40, temperature=0.0, ignore_eos=True)
    for i in range(args.c):
        engine.add_request(f"r{i}", list(range(1 + i, 513 + i)), params)
    for _ in range(-(-args.c * 512 // args.max_num_batched_tokens) + 4):
        engine.step()
    real, seen, evals = mx.async_eval, [], []

    def capture(*arrays):
        if not seen:
            path = f"/tmp/census_{args.c}.dot"
            mx.export_to_dot(path, *arrays)
            seen.append(path)
        t0 = time.perf_counter()
        out = real(*arrays)
        evals.append(time.perf_counter() - t0)
        return out

    mx.async_eval = capture
    try:
        engine.step()  # the step whose graph is written out
        evals.clear()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - t0
    finally:
        mx.async_eval = real
    labels = re.findall(r'label ="([^"]+)"', open(seen[0]).read())
    evals = sorted(evals)
    print(f"census c={args.c}: {len(labels)} nodes a step; mx.async_eval {1e3 * evals[len(evals) // 2]:.2f} ms "
          f"median ({1e3 * evals[0]:.2f}-{1e3 * evals[-1]:.2f}) over {len(evals)} steps of "
          f"{1e3 * wall / args.steps:.2f} ms")
    for name, n in collections.Counter(labels).most_common():
        print(f"  {n:6d}  {name}")


def costs(args) -> None:
    import mlx.core as mx

    c, d, h, hkv, hd = args.c, 4096, 32, 8, 128
    bf = mx.bfloat16
    x = mx.random.normal((c, d)).astype(bf)
    w = (mx.random.normal((d, d)) * 0.01).astype(bf)
    norm_w = mx.ones((d,), bf)
    qh = mx.random.normal((c, h, 1, hd)).astype(bf)
    pos = mx.arange(c, dtype=mx.int32) + 500
    pool = mx.zeros((4096, 16, hkv, hd), bf)
    slots = mx.arange(c, dtype=mx.int32) * 7
    kv = mx.random.normal((c, hkv, hd)).astype(bf)
    rope = __import__("mlx.nn", fromlist=["RoPE"]).RoPE(hd, base=1e6)
    trivial_src = "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) out[i] = inp[i];"
    plain = mx.fast.cuda_kernel(name="probe_copy", input_names=["inp"], output_names=["out"],
                                source="const unsigned int n = inp_shape[0];" + trivial_src)
    big_src = "const unsigned int n = inp_shape[0];" + trivial_src + "\n" + "\n".join(f"// pad {i:05d} " + "x" * 80
                                                                              for i in range(160))
    big = mx.fast.cuda_kernel(name="probe_copy_big", input_names=["inp"], output_names=["out"], source=big_src)
    flat = x.reshape(-1)
    tmpl = [(f"A{i}", i) for i in range(16)] + [("T", bf)]
    mx.eval(x, w, norm_w, qh, pos, pool, slots, kv, flat)

    kinds = {
        "add": (x, lambda a: a + a),
        "rms_norm": (x, lambda a: mx.fast.rms_norm(a, norm_w, 1e-6)),
        "matmul": (x, lambda a: a @ w),
        "addmm": (x, lambda a: mx.addmm(a, a, w)),
        "rope": (qh, lambda a: rope(a, offset=pos)),
        "rope_squeeze": (qh, lambda a: mx.expand_dims(rope(a, offset=pos).squeeze(2), 2)),
        "reshape_view": (x, lambda a: a.reshape(c, h, -1).reshape(c, -1)),
        "transpose_copy": (qh, lambda a: mx.contiguous(a.transpose(1, 0, 2, 3)).reshape(c, h, 1, hd)),
        "scatter": (pool, lambda p: _scatter(p, slots, kv)),
        "custom_kernel": (flat, lambda a: plain(inputs=[a], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
                                                output_shapes=[a.shape], output_dtypes=[a.dtype])[0]),
        "custom_kernel_16k_source": (flat, lambda a: big(inputs=[a], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
                                                         output_shapes=[a.shape], output_dtypes=[a.dtype])[0]),
        "custom_kernel_17_template_args": (flat, lambda a: plain(
            inputs=[a], grid=(a.size, 1, 1), threadgroup=(256, 1, 1), output_shapes=[a.shape],
            output_dtypes=[a.dtype], template=tmpl)[0]),
    }
    print(f"\nper operation, c={c}, chains of {args.n}, best of {args.repeats}:")
    print("| kind | build us | async_eval us | device wait us |\n|---|---|---|---|")
    for kind, (start, op) in kinds.items():
        best = None
        for _ in range(args.repeats + 1):  # the first: kernels compiled, caches filled
            t0 = time.perf_counter()
            y = start
            for _ in range(args.n):
                y = op(y)
            t1 = time.perf_counter()
            mx.async_eval(y)
            t2 = time.perf_counter()
            mx.eval(y)
            t3 = time.perf_counter()
            got = (t1 - t0, t2 - t1, t3 - t2)
            best = got if best is None or sum(got) < sum(best) else best
        print(f"| {kind} | {1e6 * best[0] / args.n:.1f} | {1e6 * best[1] / args.n:.1f} | "
              f"{1e6 * best[2] / args.n:.1f} |", flush=True)


def _scatter(pool, slots, kv):
    """The K/V write's form: rows of a block pool seen flat, set at the step's slots."""
    blocks, bs = pool.shape[:2]
    flat = pool.reshape(blocks * bs, *pool.shape[2:])
    flat[slots] = kv
    return flat.reshape(pool.shape)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--c", type=int, default=64)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=21, help="census: synchronous steps timed")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--parts", default="costs,census")
    args = ap.parse_args(argv)
    for part in args.parts.split(","):
        {"costs": costs, "census": census}[part](args)


if __name__ == "__main__":
    main()
