"""MTP speculation on a random-weight hybrid model: the speed-up curve against the acceptance rate.

No trained MTP weights can be downloaded here, so the drafts are forced to
agree with the target at a rate the benchmark sets: the engine's MTP layer
runs in full every step (its cost is real), then each draft token is replaced
by the target's own greedy token with probability ``p``, else by another one.
Greedy verification then accepts a draft's first ``n`` tokens with probability
``p^n`` (the rate reported is the one measured: accepted / drafted tokens).
The target's greedy tokens are those of the run without speculation; its
weights make them a fixed permutation chain with a wide margin (see
``build``), because with plain random weights a verify step of k+1 tokens
rounded differently from a one-token step at near-ties and the truth moved.
``same_tokens`` says whether the speculating engine's greedy tokens equal
them (if not, drafts agree less often than ``p``; the acceptance reported is
the one measured).

Every run, untimed ones included, sends new prompts, as a user's traffic
does: no timed run finds an earlier run's prompts in its engine's prefix
cache (prefix caching stays on, as users run it). Each row reports both
engines' ``cached_tokens`` in the timed runs.

Reported per concurrency ``c`` and ``p``: wall time and output tokens/s
without speculation (the device's default scheduling) and with MTP
(``num_speculative_tokens`` = ``--k``), their ratio, the acceptance measured,
the MTP proposal's time per step and the whole step's.

    python -m bench.speculative --method mtp --shape qwen3_5-8b --levels 1 4 16 --p 0 0.5 0.7 0.9 1
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


def _hybrid(hidden: int, layers: int, mlp: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
            linear_heads: tuple[int, int], context: int = 8192) -> dict:
    """A Qwen3.5-layout config: gated delta nets (``linear_heads``: value and key heads, of
    ``head_dim``), every 4th layer full attention."""
    return dict(model_type="qwen3_5", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=mlp,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                linear_num_value_heads=linear_heads[0], linear_num_key_heads=linear_heads[1],
                linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
                full_attention_interval=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
                max_position_embeddings=context)


# Random hybrid shapes.
SHAPES = {
    # A smoke-test shape: the script end to end in seconds on a CPU.
    "qwen3_5-tiny": _hybrid(128, 4, 256, 4, 2, 32, 1024, (4, 2)),
    # Narrow and deep: a forward's cost is its dispatch and synchronisation, as on a GPU.
    "qwen3_5-deep": _hybrid(64, 32, 128, 4, 2, 16, 1024, (4, 2)),
    # A CPU-sized shape (~75 M parameters, Qwen-like vocabulary of 32K).
    "qwen3_5-small": _hybrid(512, 8, 1536, 8, 2, 64, 32000, (8, 4)),
    # 8.1 G parameters: Qwen3-8B's width and vocabulary, 32 layers of which 8 attend (32 heads of 128,
    # 8 KV heads, an output gate), 24 gated delta nets (16 key and 32 value heads of 128).
    "qwen3_5-8b": _hybrid(4096, 32, 12288, 32, 8, 128, 151936, (32, 16), context=40960),
}


def build(shape_name: str, seed: int, dtype: str = "bfloat16"):
    """A maker of LoadedModels over one set of random arrays of ``dtype``, each with a random MTP layer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3_5 import DecoderLayer
    from mlx_lm.utils import _get_classes

    from mlxd.engined.loaders import LoadedModel
    from mlxd.engined.loaders.mlx_dir import MTPWeights
    from mlxd.engined.speculation.mtp import MTPLayer

    shape = SHAPES[shape_name]
    model_cls, args_cls = _get_classes(shape)
    mx.random.seed(seed)
    dtype = getattr(mx, dtype)

    def fresh():
        m = model_cls(args_cls.from_dict(shape))
        m.set_dtype(dtype)
        return m

    first = fresh()
    # The target's greedy next token is a fixed permutation of the current one, by a margin no rounding
    # moves: embeddings ~100x the residual branches' outputs, and the head's row for perm[t] is t's
    # embedding. Every layer still runs in full (the cost is the shape's); what this buys is a truth
    # that a verify step's rounding cannot change at any batch size, as near-ties of plain random
    # weights did (bf16 at c = 4 never settled, float32 neither, on the H200).
    text = first.language_model
    vocab, hidden = text.model.embed_tokens.weight.shape
    perm = np.random.default_rng(seed).permutation(vocab)
    embed = (100.0 * mx.random.normal((vocab, hidden))).astype(dtype)
    text.model.embed_tokens.weight = embed
    text.lm_head.weight = embed[mx.array(np.argsort(perm))]
    args = text.args
    mtp = MTPLayer(DecoderLayer(args, args.full_attention_interval - 1), args.hidden_size, args.rms_norm_eps)
    mtp.set_dtype(dtype)
    mx.eval(first.parameters(), mtp.parameters())
    mtp_weights = MTPWeights(dict(tree_flatten(mtp.parameters())), shifted_norms=False)

    def make_loaded() -> LoadedModel:
        m = fresh()
        m.update(first.parameters())  # the same arrays: each engine swaps attention in its own model object
        return LoadedModel(model=m, model_id=f"random-{shape_name}", model_type="qwen3_5", tokenizer_dir=Path("."),
                           eos_token_ids=[], bos_token_id=None, context_length=8192,
                           vocab_size=shape["vocab_size"], num_layers=shape["num_hidden_layers"],
                           num_kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"], mtp=mtp_weights)

    return make_loaded, shape["vocab_size"]


class ForcedDrafts:
    """The engine's MTP proposer, run in full, its drafts then made to agree with the target's greedy
    tokens (``truth``, by prompt) with probability ``p`` per token; times each proposal."""

    def __init__(self, inner, truth: dict[tuple, list[int]], p: float, vocab: int, seed: int):
        self.inner, self.truth, self.p, self.vocab = inner, truth, p, vocab
        self.rng = np.random.default_rng(seed)
        self.seconds, self.calls = 0.0, 0

    def retain(self, request_ids) -> None:
        self.inner.retain(request_ids)

    def forget(self, request_ids) -> None:
        self.inner.forget(request_ids)

    def propose(self, batch, drafting, drafts):
        t0 = time.perf_counter()
        out = self.inner.propose(batch, drafting, drafts)  # evaluates its drafts: synchronous
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        for req, draft in zip(drafting, drafts):
            truth = self.truth[tuple(req.token_ids[: req.num_prompt_tokens])]
            at = req.num_output_tokens  # draft j stands for output token at + j
            for j in range(len(draft)):
                if at + j < len(truth):
                    right = self.rng.random() < self.p
                    draft[j] = truth[at + j] if right else (truth[at + j] + 1) % self.vocab
        return out


def timed(engine, prompts, params) -> tuple[float, list[list[int]], int]:
    """Wall seconds, outputs and target forwards of one closed batch."""
    import mlx.core as mx

    steps = engine.num_steps
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    mx.clear_cache()
    return wall, out, engine.num_steps - steps


def main(args) -> None:
    from mlxd.engined.engine import Engine
    from mlxd.shared.config import EngineConfig
    from mlxd.shared.protocol import SamplingParams

    make_loaded, vocab = build(args.shape, args.seed, args.dtype)
    rng = np.random.default_rng(args.seed)
    base = dict(max_num_seqs=max(args.levels), max_num_batched_tokens=4096, max_model_len=4096,
                num_kv_blocks=max(args.levels) * (args.prompt_tokens + args.max_tokens + 64) // 16 + 64)
    plain = Engine(EngineConfig(**base), loaded=make_loaded())
    spec = Engine(EngineConfig(**base, speculative_config=json.dumps(
        {"method": "mtp", "num_speculative_tokens": args.k})), loaded=make_loaded())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for c in args.levels:
        def draw() -> list[list[int]]:  # new prompts for every run: none served from an earlier run's cache
            return [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(c)]

        timed(plain, draw(), params)  # untimed: kernels compile for new shapes
        cached0 = plain.stats().prefix_cache_hits
        t_plain, _, steps_plain = timed(plain, draw(), params)
        cached_plain = plain.stats().prefix_cache_hits - cached0
        for p in args.p:
            warm, prompts = draw(), draw()
            # The truth the drafts are forced to: the plain engine's greedy tokens for both (untimed runs of
            # an engine whose prefix cache the speculating one does not share).
            forced = ForcedDrafts(spec.mtp, {tuple(q): t for batch in (warm, prompts)
                                             for q, t in zip(batch, plain.generate(batch, params))},
                                  p, vocab, args.seed)
            spec.speculator.drafter = forced
            timed(spec, warm, params)  # untimed, as above
            m = spec.metrics
            drafted0, accepted0 = m.spec_draft_tokens._value.get(), m.spec_accepted._value.get()
            forced.seconds, forced.calls, cached0 = 0.0, 0, spec.stats().prefix_cache_hits
            t_spec, out, steps_spec = timed(spec, prompts, params)
            drafted = m.spec_draft_tokens._value.get() - drafted0
            accepted = m.spec_accepted._value.get() - accepted0
            tokens = c * args.max_tokens
            row = dict(c=c, p=p, k=args.k, plain_s=round(t_plain, 3), mtp_s=round(t_spec, 3),
                       plain_tok_s=round(tokens / t_plain, 1), mtp_tok_s=round(tokens / t_spec, 1),
                       speedup=round(t_plain / t_spec, 3), acceptance=round(accepted / max(drafted, 1), 3),
                       same_tokens=out == [forced.truth[tuple(q)] for q in prompts],
                       cached_tokens_plain=cached_plain, cached_tokens_mtp=spec.stats().prefix_cache_hits - cached0,
                       steps_plain=steps_plain, steps_mtp=steps_spec,
                       step_ms_plain=round(1e3 * t_plain / steps_plain, 2),
                       step_ms_mtp=round(1e3 * t_spec / steps_spec, 2),
                       mtp_propose_ms=round(1e3 * forced.seconds / max(forced.calls, 1), 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| c | p | acceptance | no spec s | MTP k={args.k} s | speed-up | tok/s no spec | tok/s MTP | "
          "step ms (no spec / MTP) | MTP proposal ms/step | cached tokens (no spec / MTP) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['c']} | {r['p']} | {r['acceptance']:.0%} | {r['plain_s']:.2f} | {r['mtp_s']:.2f} | "
              f"{r['speedup']:.2f}x | {r['plain_tok_s']:.0f} | {r['mtp_tok_s']:.0f} | "
              f"{r['step_ms_plain']:.1f} / {r['step_ms_mtp']:.1f} | {r['mtp_propose_ms']:.1f} | "
              f"{r['cached_tokens_plain']} / {r['cached_tokens_mtp']} |")
