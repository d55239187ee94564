"""The memory guard: a fixed KV pool sized from the budget, a refusal naming the numbers, flat memory under load."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engined.engine import Engine
from mlxd.engined.loaders import load_model
from mlxd.engined.memory_guard import device_memory
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import MemoryBudgetError, OverloadedError
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3", seed=3, max_position_embeddings=4096)


def engine(tiny_dir, **kw):
    return Engine(EngineConfig(**kw), loaded=load_model(str(tiny_dir)))


def test_budget_fraction_sets_the_pool_and_the_breakdown_adds_up(tiny_dir):
    e = engine(tiny_dir, gpu_memory_utilization=0.01, max_num_seqs=4, max_num_batched_tokens=256)
    m = e.memory
    # The CPU's RAM counts what is available at start-up, which moves with the host's load.
    assert abs(m.budget - 0.01 * device_memory()) < 0.01 * (512 << 20)
    assert m.weights > 0 and m.activations > 0
    per_block = e.scheduler.kv.bytes_per_block
    assert m.kv_bytes == m.num_blocks * per_block
    # Resident at start: the blocks of one max_model_len request, not the whole capacity.
    assert m.initial_blocks == 4096 // 16 < m.num_blocks
    assert e.scheduler.kv.nbytes == m.initial_blocks * per_block
    # Either the budget's remainder or the most the running cap can use, whichever is less.
    assert m.num_blocks == min((m.budget - m.weights - m.activations) // per_block, 4 * 4096 // 16)
    assert "weights" in m.describe() and f"{m.num_blocks} blocks" in m.describe()


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux reports available RAM")
def test_cpu_budget_shrinks_when_another_process_holds_ram():
    """On the CPU the pool comes out of RAM the host has free, not all of it."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    before = device_memory()
    assert before <= total
    hog = 1 << 30
    # Another process fills 1 GiB of pages and holds them until told to go.
    proc = subprocess.Popen([sys.executable, "-c", f"b = bytearray({hog}); b[::4096] = b'x' * len(b[::4096]); "
                             "print('held', flush=True); input()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        during = device_memory()
    finally:
        proc.communicate("")
    # Other tenants move a little too; the hog's gigabyte must show.
    assert before - during > hog // 2, (before, during)


def test_kv_cache_memory_overrides_the_fraction(tiny_dir):
    e = engine(tiny_dir, kv_cache_memory=64 << 20, max_num_seqs=64, max_num_batched_tokens=256)
    kv, m = e.scheduler.kv, e.memory
    # The budget less a growth step's one-array copy beyond the activations' room.
    assert m.num_blocks == ((64 << 20) + m.activations) // (kv.bytes_per_block + kv.resize_bytes_per_block)
    assert m.num_blocks * kv.bytes_per_block + m.num_blocks * kv.resize_bytes_per_block - m.activations <= 64 << 20


def test_a_budget_too_small_for_one_full_request_refuses_to_start(tiny_dir):
    with pytest.raises(MemoryBudgetError) as err:
        engine(tiny_dir, kv_cache_memory=1 << 20, max_model_len=4096, max_num_batched_tokens=256)
    msg = str(err.value)
    assert "max_model_len=4096" in msg and "needs 256 blocks" in msg and "--kv-cache-memory" in msg


def kv_bytes_of(path, num_blocks: int, **kw) -> int:
    """The KV budget of ``num_blocks`` blocks (every store's share), read off an engine given the count:
    a budget in bytes is what has the memory guard measure the activations."""
    return engine(path, num_kv_blocks=num_blocks, **kw).memory.kv_bytes


def test_a_pool_given_in_blocks_runs_no_warm_up_forward(tiny_dir):
    e = engine(tiny_dir, num_kv_blocks=40, max_num_batched_tokens=256)
    assert e.memory.activations == 0 and "activations not measured" in e.memory.describe()
    assert e.memory.num_blocks == 40


def test_requests_wait_for_blocks_and_memory_stays_flat_under_load(tiny_dir):
    # A pool for about two requests at a time; twelve arrive at once, in three waves.
    kw = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=320,
              enable_prefix_caching=False)
    e = engine(tiny_dir, kv_cache_memory=kv_bytes_of(tiny_dir, 40, **kw), **kw)
    assert e.memory.num_blocks <= 40 and e.memory.activations > 0
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    mx.reset_peak_memory()
    active_before = mx.get_active_memory()
    peaks = []
    for wave in range(3):
        prompts = [rng.integers(1, 260, size=int(n)).tolist() for n in rng.integers(100, 240, size=12)]
        outs = e.generate(prompts, params)
        assert [len(o) for o in outs] == [64] * 12
        peaks.append(mx.get_peak_memory())
        e.scheduler.kv.pool.check_whole()
    # The pool never grows: active memory returns to where it was, and the peak
    # stays within weights + KV + the measured activations.
    assert mx.get_active_memory() <= active_before + (1 << 20)
    limit = e.memory.weights + e.memory.kv_bytes + 2 * e.memory.activations
    assert max(peaks) <= limit
    assert max(peaks) - min(peaks) <= e.memory.activations
    assert mx.get_cache_memory() <= e.memory.activations


def test_the_waiting_queue_is_bounded(tiny_dir):
    e = engine(tiny_dir, num_kv_blocks=64, max_waiting_requests=2, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    e.add_request("a", [1, 2, 3], params)
    e.add_request("b", [1, 2, 3], params)
    with pytest.raises(OverloadedError, match="max-waiting-requests 2"):
        e.add_request("c", [1, 2, 3], params)
    while e.has_unfinished():
        e.step()
    e.add_request("c", [1, 2, 3], params)  # room again once the queue drained


def test_speculation_bills_the_verification_steps_scratch(tmp_path):
    """Verifying k drafts for every running request samples (k + 1) rows each over the whole
    vocabulary: with a large vocabulary that step, not the prefill, sets the scratch, and a sampled
    speculative run must stay inside weights + KV + the measured activations."""
    d = make_tiny_model(tmp_path / "wide", "qwen3", seed=4, vocab_size=32768)
    kw = dict(block_size=16, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=128)
    speculative = f'{{"model": "{d}", "num_speculative_tokens": 4}}'
    plain = engine(d, kv_cache_memory=kv_bytes_of(d, 160, **kw), **kw)
    spec = engine(d, kv_cache_memory=kv_bytes_of(d, 160, speculative_config=speculative, **kw),
                  speculative_config=speculative, **kw)
    assert spec.memory.activations > 2 * plain.memory.activations
    del plain
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 32768, size=int(n)).tolist() for n in rng.integers(20, 60, size=32)]
    params = [SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True) for i in range(32)]
    mx.clear_cache()
    mx.reset_peak_memory()
    outs = spec.generate(prompts, params)
    assert [len(o) for o in outs] == [16] * 32
    assert spec.metrics.spec_draft_tokens._value.get() > 0
    m = spec.memory
    assert mx.get_peak_memory() <= m.weights + m.kv_bytes + m.activations, (mx.get_peak_memory(), m)


SPEC_MTP = '{"method": "mtp", "num_speculative_tokens": 2}'


@pytest.mark.parametrize("arch, extra", [("qwen3", {}), ("qwen3_5", {}), ("llama", dict(enable_lora=True)),
                                         ("qwen3_5", dict(speculative_config=SPEC_MTP))],
                         ids=["dense", "hybrid", "lora", "hybrid-mtp"])
def test_kernel_warm_up_hands_its_slots_back(tmp_path, arch, extra):
    """warm_kernels (run in the warm-up where a GPU compiles kernels) frees what its steps took: every
    block, nothing in the prefix cache, every live state slot; a request after it generates what it
    does on an engine that never ran it. Also with LoRA slots (the runner sets each step's adapter
    rows) and with an MTP layer (whose K/V is a group of the KV manager). Here on the CPU's
    attention: what is checked is the steps' bookkeeping, the same on every backend. (A hybrid's
    state snapshots from its blocks are dropped with the warm-up's pool; here they stay, keyed by
    prompts no request sends.)"""
    from mlxd.engined import memory_guard

    path = make_tiny_model(tmp_path, arch, seed=5, mtp="speculative_config" in extra, max_position_embeddings=4096)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 40))
    cfg = dict(num_kv_blocks=128, max_num_batched_tokens=256, max_num_seqs=4, **extra)
    plain = Engine(EngineConfig(**cfg), loaded=load_model(str(path)))
    warmed = Engine(EngineConfig(**cfg), loaded=load_model(str(path)))
    kv = warmed.runner.kv
    pools = [g.pool for g in kv.groups if hasattr(g, "pool")]
    states = [g for g in kv.groups if hasattr(g, "free_live")]
    assert bool(states) == (arch == "qwen3_5")
    free = [p.num_free for p in pools]
    memory_guard.warm_kernels(warmed.runner, warmed.sampler, warmed.loaded.vocab_size)
    assert [p.num_free for p in pools] == free
    assert all(not p.cached for p in pools)
    assert all(not g.live and len(g.free_live) == g.num_live for g in states)
    assert warmed.generate([prompt], params) == plain.generate([prompt], params)
