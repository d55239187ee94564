"""GGUF quant blocks as MLX quantized weights on a GPU: do MLX's kernels compute with them?

For each GGUF type, a random (experts, out, in) weight is encoded (gguf.quants,
or tests/gguf_kquants.py for the K-quants), converted by
engined/loaders/gguf_quant.py as the loader does (scales and biases float16),
and used by ``mx.dequantize``, ``mx.quantized_matmul`` (dense layers) and
``mx.gather_qmm`` (MoE experts) on the default device. Each is compared with
the float32 values gguf dequantizes to. Needs only numpy, gguf and MLX (no
mlx_lm), so it runs on the GPU machine with MLX's CUDA wheel:

    python -m bench.gguf_quant_gpu [out.txt]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


def _module(path: Path, name: str):
    # by file, so that engined.loaders' package (which imports mlx_lm) is not imported
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def main(out: str | None = None) -> None:
    gq = _module(ROOT / "engined/loaders/gguf_quant.py", "gguf_quant")
    kq = _module(ROOT / "tests/gguf_kquants.py", "gguf_kquants")
    rng = np.random.default_rng(0)
    experts, rows, cols = 4, 256, 512
    w = (rng.standard_normal((experts, rows, cols)) / np.sqrt(cols)).astype(np.float32)
    x = rng.standard_normal((16, cols)).astype(np.float32)
    idx = rng.integers(0, experts, (16, 1)).astype(np.uint32)
    lines = [f"device: {mx.default_device()}, MLX {mx.__version__}",
             "type   bits mode    dequantize(f32 scales)  qmm rel err  gather_qmm rel err"]
    for name in TYPES:
        kind = T[name]
        data = kq.ENCODERS[name](w) if name in kq.ENCODERS else quants.quantize(w, kind)
        ref = gq.dense(data, kind, w.shape)
        p = gq.quantized(data, kind, w.shape)
        wq = mx.array(p.weight)
        s32 = mx.array(p.scales)
        b32 = None if p.biases is None else mx.array(p.biases)
        kw = {"group_size": p.group_size, "bits": p.bits, "mode": p.mode}
        deq = np.array(mx.dequantize(wq, s32, b32, **kw).astype(mx.float32))
        deq_err = float(np.abs(deq - ref).max())
        # as the loader keeps them on a GPU: scales and biases float16, activations float16
        s16 = s32 if p.mode == "mxfp4" else s32.astype(mx.float16)
        b16 = None if b32 is None else b32.astype(mx.float16)
        xa = mx.array(x).astype(mx.float16)
        want = x @ ref[0].T
        got = np.array(mx.quantized_matmul(xa, wq[0], s16[0], None if b16 is None else b16[0], transpose=True, **kw)
                       .astype(mx.float32))
        qmm = float(np.abs(got - want).max() / np.abs(want).max())
        want_g = np.einsum("tc,toc->to", x, ref[idx[:, 0]])
        got_g = mx.gather_qmm(xa[:, None, :], wq, s16, b16, rhs_indices=mx.array(idx[:, 0]), transpose=True, **kw)
        got_g = np.array(got_g.astype(mx.float32)).reshape(16, rows)
        gather = float(np.abs(got_g - want_g).max() / np.abs(want_g).max())
        lines.append(f"{name:6} {p.bits:4} {p.mode:7} {deq_err:22.3g}  {qmm:11.2e}  {gather:18.2e}")
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
