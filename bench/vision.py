"""Images on the GPU: mlxd's in-process Engine against mlx-vlm's batch generation on the same random-weight VLM.

The model is Gemma 3 4B's shape (``--shape gemma3-4b``: the 34-layer text model and the 27-layer
SigLIP tower at their real sizes, 896x896 images as 256 tokens) with random weights in bfloat16, no
download; ``--shape tiny`` runs the same code on a CPU in seconds (float32). mlx-vlm's own Gemma 3
classes make the weights (MLX's initialisation), written once to a temporary folder beside a small
byte-level tokenizer with Gemma 3's image markers and the processor's files; both sides load that
folder, so they run the same arrays.

Each run sends ``c`` requests at once, each with an image of its own and a text of its own: every
run, the untimed warm-up included, draws new random pixels and new words (no prefix cache can serve
a run from an earlier one). Decoding is greedy and every request generates exactly ``--max-tokens``
tokens (neither side is given an end token). The clock starts before the prompts are processed:

- mlxd: per request the gateway's own expansion (``gateway.media_processor.expand_with``:
  transformers' processor, the image's span and pixels), ``Engine.add_request`` for all ``c``, then
  ``Engine.step`` until all finish (the tower encodes the step's images, chunked prefill).
- mlx-vlm: its batch path as ``batch_generate`` runs a group of images of one shape: its own
  processor over the batch, left-padded (as ``prepare_inputs`` calls it, each image in a list of
  its own: ``batch_generate`` itself fails on Gemma 3 for c > 1), the model's input embeddings (the
  tower), then its ``BatchGenerator`` with prefill and completion batches of ``c``, stepped until
  all finish. It batches; mlx-vlm's server is not in the comparison.

Both get the same rendered prompts and images. Reported per (side, c): the median over
``--repeats`` of TTFT per request (p50 and max, ms) and of total tokens/s (prompt + generated over
the run's wall time), whether each request's greedy tokens agree across the sides in the last run
and where each first differs (a difference at the first token means the sides do not run the same
model, and the ratio means nothing; bfloat16 may part them later at near ties), and how many
distinct answers the last run gave (fewer than ``c`` would say the images and words barely steer
the random model).

    python -m bench.vision --shape gemma3-4b --concurrency 1 8 32 --max-tokens 64 --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mlxd.bench.pipeline import agreement, first_differences

# Gemma 3 4B as its config.json states it (google/gemma-3-4b-it); the tokenizer stays the tiny one,
# so the image marker ids are its, inside the text model's vocabulary.
SHAPES = {
    "tiny": dict(text={}, vision={}, image_size=64, image_tokens=16, dtype="f32", num_kv_blocks=64,
                 max_num_batched_tokens=64),
    "gemma3-4b": dict(
        text=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, vocab_size=262208,
                  sliding_window=1024, sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=10000.0,
                  rope_scaling={"factor": 8.0, "rope_type": "linear"}, rms_norm_eps=1e-6,
                  max_position_embeddings=131072),
        vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    patch_size=14, image_size=896),
        image_size=896, image_tokens=256, dtype="bf16", num_kv_blocks=4096, max_num_batched_tokens=8192),
}

WORDS = ("the a cat dog sat on mat look at this picture what is in it describe colour shape light dark "
         "left right above below near far small large red green blue why how many people tree house").split()


def build(shape: str, directory: Path, seed: int) -> Path:
    """A Gemma 3 checkpoint of ``shape`` with random weights in ``directory``; its path."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxd.engined.vision.tower import vlm_config
    from tests.vision_models import make_tiny_gemma3_vlm

    spec = SHAPES[shape]
    path = make_tiny_gemma3_vlm(directory, seed=seed)  # the tokenizer, template and processor files
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(spec["text"], mm_tokens_per_image=spec["image_tokens"])
    config["vision_config"].update(spec["vision"])
    config.update(mm_tokens_per_image=spec["image_tokens"], hidden_size=config["text_config"]["hidden_size"],
                  vocab_size=config["text_config"]["vocab_size"])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, update in (("preprocessor_config.json", {"size": {"height": spec["image_size"],
                                                                "width": spec["image_size"]}}),
                         ("processor_config.json", {"image_seq_length": spec["image_tokens"]})):
        settings = json.loads((path / name).read_text()) | update
        (path / name).write_text(json.dumps(settings, indent=2))

    mx.random.seed(seed)
    module, model_config = vlm_config(config, path)
    model = module.Model(model_config)
    model.set_dtype(mx.float32 if spec["dtype"] == "f32" else mx.bfloat16)
    # Gemma 3's head is its embedding: a checkpoint stores none.
    weights = {k: v for k, v in tree_flatten(model.parameters()) if not k.endswith("lm_head.weight")}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    del model, weights
    mx.clear_cache()
    return path


def fresh_requests(processor, c: int, size: int, rng: np.random.Generator) -> list[tuple[str, object]]:
    """``c`` (rendered prompt, PIL image) pairs: new random pixels and new words at every call."""
    from PIL import Image

    out = []
    for _ in range(c):
        text = " ".join(rng.choice(WORDS, 12)) + "?"
        content = [{"type": "image"}, {"type": "text", "text": text}]
        rendered = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                           add_generation_prompt=True, tokenize=False)
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        out.append((rendered, Image.fromarray(pixels, "RGB")))
    return out


def run_mlxd(engine, processor, image_id: int, requests, max_tokens: int) -> dict:
    from mlxd.gateway.media import Image
    from mlxd.gateway.media_processor import expand_with
    from mlxd.shared.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    run_mlxd.counter += 1
    t0 = time.perf_counter()
    prompt_tokens = 0
    for i, (rendered, pil) in enumerate(requests):
        image = Image(pil, hashlib.sha256(pil.tobytes()).hexdigest())
        ids, images = expand_with(processor, image_id, rendered, [image])
        prompt_tokens += len(ids)
        engine.add_request(f"v{run_mlxd.counter}-{i}", ids, params, images=images)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    first: dict[int, float] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids:
                i = int(o.request_id.rsplit("-", 1)[1])
                first.setdefault(i, time.perf_counter() - t0)
                tokens[i] += o.new_token_ids
    return dict(wall=time.perf_counter() - t0, ttft=[first[i] for i in range(len(requests))],
                prompt_tokens=prompt_tokens, tokens=[tokens[i] for i in range(len(requests))])


run_mlxd.counter = 0


def run_mlx_vlm(model, processor, requests, max_tokens: int) -> dict:
    """mlx-vlm's batch path for one group of same-shaped images (``batch_generate``'s own steps),
    stepped here so that each request's first token is timed and its token ids kept."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import BatchGenerator, _split_prompt_kwargs_per_row
    from mlx_vlm.utils import should_add_special_tokens

    c = len(requests)
    t0 = time.perf_counter()
    # Its processor over the batch, left-padded, as prepare_inputs calls it, but with each request's
    # image in a list of its own: prepare_inputs' flat list reads as c images of one request in
    # Gemma 3's processor, which then refuses c texts (batch_generate fails there for c > 1).
    out = processor(text=[r for r, _ in requests], images=[[pil] for _, pil in requests], padding=True,
                    padding_side="left", return_tensors="np",
                    add_special_tokens=should_add_special_tokens(model.config.model_type, processor))
    inputs = {k: mx.array(np.asarray(v)) for k, v in out.items()}
    input_ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    data = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    embedded = model.get_input_embeddings(input_ids, inputs.get("pixel_values"), mask=mask, **data)
    prompt_kwargs = {**data, **{k: v for k, v in embedded.to_dict().items() if v is not None}}
    gen = BatchGenerator(model.language_model, processor, prefill_batch_size=c, completion_batch_size=c,
                         compute_logprobs=False)
    uids = gen.insert(input_ids, max_tokens, prompt_kwargs=_split_prompt_kwargs_per_row(prompt_kwargs, c),
                      attention_mask=mask)
    tokens = {u: [] for u in uids}
    first: dict[int, float] = {}
    while gen.has_work:
        _, responses = gen.next()
        for r in responses:
            first.setdefault(r.uid, time.perf_counter() - t0)
            tokens[r.uid].append(int(r.token))
    wall = time.perf_counter() - t0
    gen.close()
    prompt_tokens = int(mask.sum().item()) if mask is not None else input_ids.size
    mx.clear_cache()
    return dict(wall=wall, ttft=[first[u] for u in uids], prompt_tokens=prompt_tokens,
                tokens=[tokens[u] for u in uids])


def summary(side: str, c: int, runs: list[dict], differ: list[int | None], args) -> dict:
    """One (side, c) row: medians over the timed runs."""
    total = [(r["prompt_tokens"] + sum(map(len, r["tokens"]))) / r["wall"] for r in runs]
    generated = [sum(map(len, r["tokens"])) / r["wall"] for r in runs]
    return dict(shape=args.shape, side=side, c=c, max_tokens=args.max_tokens, repeats=len(runs),
                ttft_p50_ms=round(1e3 * statistics.median(statistics.median(r["ttft"]) for r in runs), 1),
                ttft_max_ms=round(1e3 * statistics.median(max(r["ttft"]) for r in runs), 1),
                total_tok_s=round(statistics.median(total), 1), gen_tok_s=round(statistics.median(generated), 1),
                prompt_tokens=runs[0]["prompt_tokens"], seconds=[round(r["wall"], 3) for r in runs],
                first_difference=differ,
                distinct_answers=len({tuple(t) for t in runs[-1]["tokens"]}))


def emit(row: dict, out: str | None) -> None:
    """Print ``row``, and append it to ``out`` as it comes: a run cut by its time limit keeps what it measured."""
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def table(rows: list[dict]) -> str:
    lines = ["| c | mlxd TTFT p50 / max (ms) | mlx-vlm TTFT p50 / max (ms) | mlxd tok/s | mlx-vlm tok/s | "
             "tok/s ratio | TTFT p50 ratio | tokens agree |", "|---|---|---|---|---|---|---|---|"]
    for c in sorted({r["c"] for r in rows}):
        m, v = ({r["side"]: r for r in rows if r["c"] == c}[s] for s in ("mlxd", "mlx_vlm"))
        lines.append(f"| {c} | {m['ttft_p50_ms']} / {m['ttft_max_ms']} | {v['ttft_p50_ms']} / {v['ttft_max_ms']} | "
                     f"{m['total_tok_s']} | {v['total_tok_s']} | {m['total_tok_s'] / v['total_tok_s']:.2f}x | "
                     f"{v['ttft_p50_ms'] / m['ttft_p50_ms']:.2f}x | "
                     f"{agreement(m['first_difference'])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gemma3-4b", choices=sorted(SHAPES))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per (side, c), after one untimed")
    ap.add_argument("--num-kv-blocks", type=int, help="mlxd's KV pool (default: the shape's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="where the checkpoint is written (default: a temporary folder)")
    ap.add_argument("--out", help="append the rows as JSON lines to this file, each as it comes")
    args = ap.parse_args(argv)
    print(f"seed {args.seed}", flush=True)
    import mlx.core as mx
    from mlx_vlm.utils import load

    from mlxd.engined.engine import Engine
    from mlxd.engined.loaders import load_model
    from mlxd.gateway.media_processor import image_token_id
    from mlxd.shared.config import EngineConfig
    from tests.vision_models import processor_of

    spec = SHAPES[args.shape]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        t0 = time.perf_counter()
        path = build(args.shape, Path(tmp) / args.shape, args.seed)
        print(json.dumps(dict(shape=args.shape, dtype=spec["dtype"], built_s=round(time.perf_counter() - t0, 1),
                              checkpoint_gb=round((path / "model.safetensors").stat().st_size / 1e9, 2))), flush=True)
        model, vlm_processor = load(str(path))
        # No end token on either side: every request generates exactly --max-tokens.
        vlm_processor.tokenizer.stopping_criteria.eos_token_ids = []
        vlm_processor.tokenizer.stopping_criteria.additional_eos_token_ids = []
        # transformers' processor, as the gateway loads it (mlx-vlm, imported, answers AutoProcessor with its own)
        processor = processor_of(path)
        image_id = image_token_id(processor)
        engine = Engine(EngineConfig(max_num_seqs=max(args.concurrency), num_kv_blocks=args.num_kv_blocks or
                                     spec["num_kv_blocks"], max_num_batched_tokens=spec["max_num_batched_tokens"],
                                     max_model_len=4096), loaded=load_model(str(path)))  # the device's defaults
        rng = np.random.default_rng(args.seed)
        rows = []
        for c in args.concurrency:
            runs = {"mlxd": [], "mlx_vlm": []}
            differ = []
            for rep in range(args.repeats + 1):  # the first is untimed: kernels compile for new shapes
                requests = fresh_requests(processor, c, spec["image_size"], rng)
                # Which side runs goes to stderr first: a backend that aborts the process leaves it as the last line
                print(f"c = {c}, run {rep}: mlx-vlm", file=sys.stderr, flush=True)
                vlm = run_mlx_vlm(model, vlm_processor, requests, args.max_tokens)
                print(f"c = {c}, run {rep}: mlxd", file=sys.stderr, flush=True)
                ours = run_mlxd(engine, processor, image_id, requests, args.max_tokens)
                assert all(len(t) == args.max_tokens for t in ours["tokens"] + vlm["tokens"])
                differ = first_differences(ours["tokens"], vlm["tokens"])
                if rep:
                    runs["mlxd"].append(ours)
                    runs["mlx_vlm"].append(vlm)
            for side, timed in runs.items():
                rows.append(summary(side, c, timed, differ, args))
                emit(rows[-1], args.out)
            gc.collect()
            mx.clear_cache()
    print(f"\n{args.shape} {spec['dtype']}, {args.max_tokens} tokens a request, mlx-vlm batched "
          f"(BatchGenerator, one group of c); ratios mlxd over mlx-vlm (TTFT: mlx-vlm's over mlxd's)\n")
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
