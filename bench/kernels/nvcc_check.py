"""Compile the CUDA kernels with a local nvcc, as MLX would wrap them: paged attention (every
dialect configuration), the gated delta rule (``engined.kernels.gated_delta``), the LoRA term
(``engined.kernels.lora_term``) and the joined projection's q/k/v (``engined.kernels.qk_rope``).

No GPU needed: it catches syntax and type errors before device time is spent.
Usage: python bench/kernels/nvcc_check.py [--arch sm_90]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import mlx.core as mx  # noqa: E402

from mlxd.engined.kernels import gated_delta, gpu, gpu_geometry, lora_term, qk_rope, source  # noqa: E402

SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int32_t",
              "uint32": "uint32_t", "bool": "bool"}


def wrap(name, header, body, inputs, outputs, template):
    """Mirror of the signature MLX generates for mx.fast.cuda_kernel (inputs const, outputs mutable)."""
    lines = [
        "#include <cuda_bf16.h>", "#include <cuda_fp16.h>", "#include <cstdint>",
        "#include <cooperative_groups.h>", "#include <cuda/std/array>",
        "using Shape = cuda::std::array<int32_t, 10>;", header,
        "namespace mlx::core::cu {", "namespace cg = cooperative_groups;",
        f"__global__ void {name}(",
    ]
    # An input named ``*_shape`` is the shape MLX passes by value after its array where the source reads it.
    params = [f"    const __grid_constant__ Shape {n}" if n.endswith("_shape") else f"    const {CUDA_TYPES[t]}* {n}"
              for n, t in inputs]
    params += [f"    {CUDA_TYPES[t]}* {n}" for n, t in outputs]
    lines.append(",\n".join(params) + ") {")
    for k, v in template:
        if isinstance(v, bool):
            lines.append(f"  constexpr bool {k} = {'true' if v else 'false'};")
        elif isinstance(v, str):
            lines.append(f"  using {k} = {CUDA_TYPES[v]};")
        else:
            lines.append(f"  constexpr int {k} = {v};")
    lines += [body, "}", "}"]
    return "\n".join(lines)


def compile_one(tag: str, text: str, arch: str) -> tuple[bool, str]:
    """(compiled, a line of registers and spills, with nvcc's errors after it when it failed)."""
    with tempfile.NamedTemporaryFile("w", suffix=".cu", delete=False) as f:
        f.write(text)
    r = subprocess.run(["nvcc", "-std=c++17", f"-arch={arch}", "-c", "-o", os.devnull, "-Xptxas", "-v", f.name],
                       capture_output=True, text=True)
    os.unlink(f.name)
    regs = [ln for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln]
    report = f"{tag}: rc={r.returncode} {' | '.join(x.strip() for x in regs)}"
    return r.returncode == 0, report + ("\n" + r.stderr[-3000:] if r.returncode else "")


def other_kernels(dtypes: tuple[str, ...]) -> list[tuple[str, str]]:
    """The gated delta rule, in bf16 and float32; the LoRA term of a folded q/k/v group and of a gate/up group with
    its activation (Llama-8B's shapes): (tag, source) to compile."""
    jobs = []
    for dt in dtypes:
        # q/k/v; gate/up with its activation; o_proj with the block's residual
        for form, (width, out) in (("", (48, 6144)), ("glu", (32, 14336)), ("residual", (16, 4096))):
            body = lora_term.source(getattr(mx, dt), width, out, 2 * out if form == "glu" else out, form == "glu",
                                    form == "residual")
            text = wrap("lora_term", "", body,
                        [("y", dt), ("y_shape", None), ("h", dt), ("h_shape", None), ("b", dt), ("b_shape", None),
                         ("slots", "uint32")] + [("r", dt)] * (form == "residual"), [("out", dt)], [])
            jobs.append((f"lora term {form} {dt}", text))
        # q/k/v from the joined projection: Qwen3-8B's heads with their norms, SmolLM2-135M's without
        for heads, kv_heads, d, eps in ((32, 8, 128, 1e-6), (9, 3, 64, None)):
            text = wrap("qk_rope", "", qk_rope.source(getattr(mx, dt), heads, kv_heads, d, 1e6, 1.0, eps),
                        [("qkv", dt), ("pos", "int32"), ("pos_shape", None)]
                        + [("qw", dt), ("kw", dt)] * (eps is not None), [("q", dt), ("k", dt), ("v", dt)], [])
            jobs.append((f"qk rope D={d} norm={eps is not None} {dt}", text))
    for dt in [d for d in dtypes if d != "float16"]:
        for mask in (False, True):
            for vec in (False, True):
                ins = [("q", dt), ("k", dt), ("v", dt), ("g", "float32"), ("beta", dt), ("state_in", "float32"),
                       ("iparams", "int32"), ("mask", "bool")]
                text = wrap("gated_delta", gated_delta._HEADER, gated_delta._SOURCE, ins,
                            [("y", dt), ("state_out", "float32")],
                            [("InT", dt), ("GT", "float32"), ("BT", dt), ("StT", "float32"), ("Dk", 128),
                             ("Dv", 128), ("Hk", 16), ("Hv", 32), ("MASK", mask), ("VEC", vec)])
                jobs.append((f"gated delta {dt} mask={mask} vec={vec}", text))
    return jobs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--unroll", type=int, default=gpu_geometry.decode_unroll(16))
    ap.add_argument("--acc-registers", action="store_true", help="decode accumulators stay in registers")
    ap.add_argument("--quick", action="store_true", help="bfloat16 and float32 only, two attention configurations")
    args = ap.parse_args()
    jobs = other_kernels(("bfloat16", "float32") if args.quick else ("bfloat16", "float16", "float32"))
    h, b = source.render_main("cuda")
    rh, rb = source.render_reduce("cuda")
    gh_, gb_ = source.render_gather("cuda")
    configs = [(dt, d, g) for dt in ("bfloat16", "float16", "float32")
               for d, g in ((128, 4), (64, 1), (80, 8), (96, 2), (256, 2))]
    if args.quick:
        configs = [("bfloat16", 128, 4), ("float32", 80, 8)]
    for dt, d, g in configs:
        ins = [("q", dt), ("k_cache", dt), ("v_cache", dt), ("cu_seqlens_q", "int32"),
               ("seq_lens", "int32"), ("block_tables", "int32"), ("iparams", "int32"), ("fparams", "float32")]
        outs = [("out", dt), ("part_o", "float32"), ("part_ml", "float32")]
        gh = gpu_geometry.row_heads("cuda", d, g)
        common = [("T", dt), ("D", d), ("G", g), ("HKV", 8), ("BS", 16), ("RT", 32), ("BN", 32),
                  ("LPT", gpu_geometry.lanes_per_token(d)), ("U", args.unroll), ("GH", gh), ("NS", g // gh),
                  ("SC", gpu_geometry.SUBCHUNK["cuda"]), ("AS", not args.acc_registers), ("SMEM_F", 10000), ("SMEM_I", 512)]
        tmpl = common + [("ROWS", True), ("TILES", True)]
        src = wrap("attn", h, b, ins, outs, tmpl)
        rows_only = wrap("attn_rows", h, b, ins, outs, common + [("ROWS", True), ("TILES", False)])
        rsrc = wrap("reduce", rh, rb,
                    [("full", dt), ("part_o", "float32"), ("part_ml", "float32"), ("cu_seqlens_q", "int32"),
                     ("seq_lens", "int32"), ("iparams", "int32")], [("out", dt)],
                    [("T", dt), ("D", d), ("H", 8 * g)])
        gins = [(n, dt if n.endswith("_cache") else "int32") for n in source.GATHER_INPUTS]
        gsrc = wrap("gather", gh_, gb_, gins, [(n, dt) for n in source.GATHER_OUTPUTS],
                    [("T", dt), ("D", d), ("HKV", 8), ("BS", 16), ("W", 16 // SIZES[dt])])
        jobs += [(f"{tag} {dt} D={d} G={g}", text)
                 for tag, text in (("main", src), ("rows only", rows_only), ("reduce", rsrc), ("gather", gsrc))]
    # Each nvcc is one process on one core: as many at once as there are cores.
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda job: compile_one(*job, args.arch), jobs))
    for _, report in results:
        print(report)
    return 0 if all(ok for ok, _ in results) else 1

if __name__ == "__main__":
    sys.exit(main())
