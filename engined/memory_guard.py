"""Sizes the KV pool from a memory budget, so memory never grows past it.

budget = gpu_memory_utilization x device memory (``--kv-cache-memory`` replaces
the fraction's result for the pool). A warm-up forward of the largest step the
scheduler can build measures what activations and scratch need at peak; MLX's
buffer cache is capped at that, and what is left becomes the KV pool's capacity.
A pool given in blocks (``--num-kv-blocks``) skips that forward: it has nothing
to size.

Admission counts on the whole capacity, but only part of it is resident: the
pool starts with the blocks of one ``max_model_len`` request and grows in
doubling steps as load needs (``kv.manager.BlockPool``), so an idle engine holds
little. A growth step copies one array at a time after handing MLX's buffer
cache back, so its transient is one array at full capacity, which must fit in
the activations' room; the capacity is cut where it would not.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from mlxd.engined.request import Request
from mlxd.engined.sampler import Sampler
from mlxd.engined.scheduler import SchedulerOutput
from mlxd.engined.speculation.speculator import Verifier
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import MemoryBudgetError
from mlxd.shared.protocol import SamplingParams

log = logging.getLogger("mlxd.engine")

GiB = 1 << 30


def device_memory() -> int:
    """Bytes the device can use: Metal's recommended working set, CUDA's memory, else the OS's RAM.

    RAM is shared with everything else on the host: on Linux it counts what the
    kernel reports available now plus what MLX already holds for this engine
    (its weights), never more than the whole. Counting all of it let a default
    engine on a busy machine size a pool the OOM killer later took back.
    """
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = _available_ram()
    return total if available is None else min(total, available + mx.get_active_memory())


def _available_ram() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class MemoryPlan:
    budget: int  # bytes the engine may use in all (0 when the pool size was given in blocks)
    weights: int
    activations: int  # peak scratch of the largest step, also MLX's buffer-cache cap
    kv_bytes: int
    num_blocks: int
    block_size: int
    fixed_bytes: int = 0  # pools sized by max_num_seqs, not by the budget (state slots, window K/V)
    initial_blocks: int = 0  # blocks resident at start (and after idle); the pool grows to num_blocks

    @property
    def resident_blocks(self) -> int:
        return self.initial_blocks or self.num_blocks

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        gb = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        budget = gb(self.budget) if self.budget else "n/a (--num-kv-blocks)"
        activations = (f"activations {gb(self.activations)} (buffer cache capped there)" if self.activations
                       else "activations not measured")
        return (
            f"memory: budget {budget}; weights {gb(self.weights)}; {activations}; KV cache {gb(self.kv_bytes)} = {self.num_blocks} blocks "
            f"x {self.block_size} = {self.kv_tokens} tokens, {self.resident_blocks} of them resident at start "
            f"(grown as load needs, cut back after idle)"
            + (f"; fixed pools (state slots, window K/V, LoRA host copies) {gb(self.fixed_bytes)}"
               if self.fixed_bytes else "")
        )


def warm_up(runner, config: EngineConfig, max_model_len: int, vocab_size: int, progress: bool) -> int:
    """Run the largest prefill step, the widest sampling and verification steps; returns peak
    scratch bytes, with headroom.

    ``runner`` is an ``engined.runner.ModelRunner``; its KV manager is created
    just large enough for the step, and dropped again after.
    """
    tokens = min(config.max_num_batched_tokens, max_model_len)
    kv = runner.kv
    kv.create(kv.blocks_for(tokens))
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    rng = np.random.default_rng(0)
    bar = tqdm(total=2, desc="warm-up", disable=not progress, leave=False)
    # One step: it is the start-up's longest wait on a CPU (minutes on a slow one). A step's peak
    # varies by which of its largest intermediates MLX's own thread still holds (a spread of 13 %
    # measured on a tiny model); the headroom below covers that spread.
    req = Request("warm-up", rng.integers(0, vocab_size, size=tokens).tolist(), SamplingParams(), 0)
    if not kv.allocate(req, tokens):
        raise RuntimeError("the warm-up step did not fit a KV cache sized for it")
    logits = runner.run(SchedulerOutput([(req, tokens)]))
    mx.eval(logits, kv.arrays())
    kv.free(req)
    del logits
    bar.update()
    # The widest sampling step: every running sequence with penalties and top-p.
    rows = config.max_num_seqs
    wide = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, logprobs=5)
    reqs = [Request(f"w{i}", [1, 2], wide, i) for i in range(rows)]
    sampler = Sampler(vocab_size, [])
    sampled, lp = sampler(mx.zeros((rows, vocab_size)), reqs)
    mx.eval(sampled, lp)
    del sampled, lp
    if config.speculative is not None:
        _warm_up_verification(sampler, reqs, config, tokens, vocab_size)
    bar.update()
    bar.close()
    peak = mx.get_peak_memory() - base
    kv.create(0)  # also drops what the steps left: hybrid models' state snapshots
    mx.clear_cache()
    # Headroom for the spread above: serving's worst step, over hundreds of steps, is the top of it.
    return max(peak, 0) * 5 // 4


def warm_kernels(runner, sampler: Sampler, vocab_size: int) -> None:
    """Run five small steps, one of each kind a GPU kernel is compiled for, and sample them, so that
    the first requests do not pay the compilation.

    A GPU compiles the attention kernel once per variant (decode rows only, prefill tiles only,
    both in one launch, a merge pass for contexts longer than one partition) and MLX's own
    kernels per dtype and layout (a short chunk's gather, a long chunk's SDPA over cached
    context), each on first use: on the H200 the first steps of short prefill chunks with a
    cached prefix cost seconds (bench/gpu_serving_results.md, run 5). The warm-up's largest
    step meets none of these. Its blocks and state slots are freed.
    """
    from mlxd.engined.kernels.gpu import SDPA_CHUNK_TOKENS
    from mlxd.engined.kernels.gpu_geometry import PARTITION_TOKENS

    kv = runner.kv
    short, long = 16, PARTITION_TOKENS + SDPA_CHUNK_TOKENS
    rng = np.random.default_rng(0)
    a, b = (Request(f"warm-kernels-{i}", rng.integers(0, vocab_size, short).tolist(), SamplingParams(), 0)
            for i in range(2))
    try:
        for scheduled in ([(a, short)], [(a, 1), (b, short)], [(a, 1), (b, 1)], [(a, 1), (b, long)],
                          [(a, 1), (b, 1)]):
            for req, n in scheduled:
                # Each step ends every request's known tokens, so each samples a row, as decoding does.
                missing = req.num_computed_tokens + n - len(req.token_ids)
                req.token_ids.extend(rng.integers(0, vocab_size, max(missing, 0)).tolist())
                if not kv.allocate(req, n):
                    return  # a pool too small for this is one a GPU serving run never has
            logits = runner.run(SchedulerOutput(scheduled))
            sampled, _ = sampler(logits, [req for req, _ in scheduled])
            mx.eval(sampled, kv.arrays())
            for req, n in scheduled:
                req.num_computed_tokens += n
    finally:
        kv.free(a)
        kv.free(b)


def _warm_up_verification(sampler: Sampler, reqs: list[Request], config: EngineConfig, tokens: int,
                          vocab_size: int) -> None:
    """The widest verification step: a logits row per draft and one bonus row for each request
    (as many as the step's token budget holds), with the draft distributions a draft model or an
    MTP layer hands over; its scratch is rows x vocabulary several times over, past the plain
    sampling step's."""
    spec = config.speculative
    k = spec.num_speculative_tokens
    reqs = reqs[: max(1, tokens // (k + 1))]
    rows = len(reqs) * (k + 1)
    draft_probs = None if spec.method == "ngram" else mx.full((rows, vocab_size), 1.0 / vocab_size)
    accept, alt = Verifier(sampler)(mx.zeros((rows, vocab_size)), reqs, [[1] * k for _ in reqs], draft_probs)
    mx.eval(accept, alt)


def plan(runner, stores: list, config: EngineConfig, max_model_len: int, vocab_size: int,
         progress: bool = False, kernels: bool = False) -> MemoryPlan:
    """Warm up, then choose the pool size; raises MemoryBudgetError when one full-length request cannot fit.

    ``stores`` are what holds KV arrays (the runner's KV manager, a draft
    model's K/V): each reports its ``bytes_per_block`` (billed per block of the
    main pool) and ``fixed_bytes`` (pools sized by configuration, set aside first).
    """
    # Arrays in reference cycles (a model's attention modules and their step context form
    # one) stay allocated until the collector runs: collect them first, so that an engine
    # started in a process that dropped another does not count the old one as its weights.
    gc.collect()
    weights = mx.get_active_memory()
    activations = 0
    # A pool given in blocks (--num-kv-blocks) needs no measurement, and MLX's buffer cache then
    # keeps its own limit.
    if config.num_kv_blocks is None:
        activations = warm_up(runner, config, max_model_len, vocab_size, progress)
        mx.set_cache_limit(activations)
    if kernels:
        # On a pool of their own, dropped after with any state snapshot the steps left.
        from mlxd.engined.kernels.gpu import SDPA_CHUNK_TOKENS
        from mlxd.engined.kernels.gpu_geometry import PARTITION_TOKENS

        runner.kv.create(2 * runner.kv.blocks_for(PARTITION_TOKENS + SDPA_CHUNK_TOKENS + 32))
        warm_kernels(runner, Sampler(vocab_size, []), vocab_size)
        runner.kv.create(0)
        mx.clear_cache()
    return size_pool(weights, activations, stores, config, max_model_len)


def size_pool(weights: int, activations: int, stores: list, config: EngineConfig, max_model_len: int) -> MemoryPlan:
    """The pool that fits the budget beside ``weights`` and ``activations`` (bytes measured on this
    device); raises MemoryBudgetError when one full-length request cannot fit."""
    needed = -(-max_model_len // config.block_size)
    per_block = sum(s.bytes_per_block for s in stores)
    fixed = sum(s.fixed_bytes for s in stores)
    if config.num_kv_blocks is not None:
        return MemoryPlan(0, weights, activations, config.num_kv_blocks * per_block,
                          config.num_kv_blocks, config.block_size, fixed, min(needed, config.num_kv_blocks))
    if per_block == 0:  # a pipeline rank of linear layers only: any pool fits beside its fixed ones
        return MemoryPlan(0, weights, activations, 0, config.max_num_seqs * needed, config.block_size, fixed,
                          needed)
    memory = device_memory()
    budget = int(config.gpu_memory_utilization * memory)
    if config.kv_cache_memory is not None:
        kv = config.kv_cache_memory
        source = f"--kv-cache-memory {kv} bytes"
    else:
        kv = budget - weights - activations - fixed
        source = (f"--gpu-memory-utilization {config.gpu_memory_utilization} x {memory / GiB:.2f} GiB"
                  f" = {budget / GiB:.2f} GiB, less weights {weights / GiB:.2f} GiB"
                  f" and activations {activations / GiB:.2f} GiB"
                  + (f" and fixed pools {fixed / GiB:.2f} GiB" if fixed else ""))
    num_blocks = max(kv, 0) // per_block
    if num_blocks < needed:
        raise MemoryBudgetError(
            f"the KV cache budget ({source}) holds {num_blocks} blocks of {config.block_size} tokens "
            f"({num_blocks * config.block_size} tokens), but one request of max_model_len={max_model_len} "
            f"needs {needed} blocks ({needed * per_block / GiB:.2f} GiB); raise --gpu-memory-utilization "
            f"or --kv-cache-memory, or lower --max-model-len"
        )
    # More blocks than every running sequence at full length could use would only sit idle.
    num_blocks = min(num_blocks, config.max_num_seqs * needed)
    # A growth step's one-array copy beyond the activations' room comes out of the pool's capacity;
    # a pool of one request's blocks starts full and never grows, so it needs no such room.
    resize = max(s.resize_bytes_per_block for s in stores)
    num_blocks = max(needed, min(num_blocks, (max(kv, 0) + activations) // (per_block + resize)))
    return MemoryPlan(budget, weights, activations, num_blocks * per_block, num_blocks, config.block_size, fixed,
                      needed)


def plan_encoder(embed, weights: int, config: EngineConfig, max_len: int) -> MemoryPlan:
    """An encoder's plan: no KV pool; weights plus its largest batch's peak must fit the budget.

    ``embed(token_ids)`` is ``EncoderModel.embed``; the largest batch the
    encoder engine builds is ``max_num_batched_tokens // max_len`` rows of
    ``max_len`` tokens (at least one row, at most ``max_num_seqs``), which
    maximises attention's ``rows x length^2`` scratch for the token budget.
    Raises MemoryBudgetError, naming the numbers, when it does not fit.
    """
    rows = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // max_len))
    gc.collect()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    embed([[1] * max_len for _ in range(rows)])
    activations = max(mx.get_peak_memory() - base, 0)
    mx.clear_cache()
    mx.set_cache_limit(activations)
    memory = device_memory()
    budget = int(config.gpu_memory_utilization * memory)
    if weights + activations > budget:
        raise MemoryBudgetError(
            f"the encoder's weights ({weights / GiB:.2f} GiB) and its largest batch ({rows} x {max_len} tokens, "
            f"{activations / GiB:.2f} GiB) exceed --gpu-memory-utilization {config.gpu_memory_utilization} x "
            f"{memory / GiB:.2f} GiB; raise it, or lower --max-num-batched-tokens"
        )
    return MemoryPlan(budget, weights, activations, 0, 0, config.block_size)
