"""The prefix cache's disk tier: blocks evicted from a small pool come back from files, giving the
tokens a recompute gives; damaged files are recomputed; the budget holds; a new engine finds the files."""

import argparse
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from mlxd import cli
from mlxd.engined.engine import Engine
from mlxd.engined.kv import disk_store
from mlxd.engined.kv.disk_tier import MIN_PREFILL_SAMPLE, Rate
from mlxd.engined.kv.manager import hash_block
from mlxd.engined.loaders import load_model
from mlxd.engined.metrics import StatsLog
from mlxd.flags import build_config
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import SamplingParams
from tests.engined.test_lora import random_adapter, write_mlx_lm
from tests.tiny_models import fresh_seed, make_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = 8
# A pool of 40 blocks holds two of the sessions below (15 blocks each, and their answers), not three.
POOL = 40
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"dense": make_tiny_model(root / "dense", "llama", seed=3),
            # Sliding-window layers in a pool of their own beside full attention.
            "window": make_tiny_model(root / "window", "gemma3_text", seed=4),
            # Gated delta nets (recurrent-state snapshots) beside full attention.
            "hybrid": make_tiny_model(root / "hybrid", "qwen3_next", seed=5)}


def engine(model_dir, disk_dir, budget=2**30, **kw):
    config = EngineConfig(num_kv_blocks=POOL, block_size=BLOCK, max_num_batched_tokens=128, max_num_seqs=4,
                          kv_disk_cache=True, kv_cache_dir=str(disk_dir), kv_disk_budget=budget, **kw)
    return Engine(config, loaded=load_model(str(model_dir)))


def run(eng, prompt, rid, lora=None):
    """One request to its end: (tokens, cached prompt tokens)."""
    eng.add_request(rid, prompt, GREEDY, lora_name=lora)
    toks, cached = [], None
    while eng.has_unfinished():
        for out in eng.step():
            toks += out.new_token_ids
            cached = out.num_cached_tokens
    return toks, cached


def sessions(seed, n=3, length=121):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 260, size=length).tolist() for _ in range(n)]


def evict_then_return(eng, prompts, lora=None):
    """Session 0, then the others (which evict its blocks to disk), then session 0 again."""
    first = run(eng, prompts[0], "a0", lora)
    for i, p in enumerate(prompts[1:]):
        run(eng, p, f"b{i}", lora)
    eng.scheduler.kv.disk.store.flush()
    return first, run(eng, prompts[0], "a1", lora)


# Asynchronous scheduling too (as on a GPU, steps encoded on a thread of their own as on CUDA): the next
# step is built while one is in flight, and a hybrid's snapshots are evicted while a step is being built.
@pytest.mark.parametrize("kind,asynchronous", [("dense", False), ("window", False), ("hybrid", False),
                                               ("hybrid", True)])
def test_a_disk_hit_gives_the_tokens_of_a_recompute(models, tmp_path, kind, asynchronous):
    seed = fresh_seed(kind)
    eng = engine(models[kind], tmp_path / "kv", async_scheduling=asynchronous, encode_thread=asynchronous,
                 attention_backend="reference" if asynchronous else "auto")
    assert eng.async_scheduling == asynchronous and (eng.encoder is not None) == asynchronous
    tier = eng.scheduler.kv.disk
    assert tier is not None and len(tier.parts) == len(eng.scheduler.kv.groups)
    # Four sessions: the others also cycle the window pool and the snapshot slots.
    (first, cached0), (again, cached1) = evict_then_return(eng, sessions(seed, n=4))
    assert cached0 == 0
    assert tier.store.totals.hit_blocks > 0, "session 0's blocks should have come back from disk"
    # The whole prefix: every group resumed from it (a window's blocks, the state at its end).
    assert cached1 == (len(sessions(seed)[0]) - 1) // BLOCK * BLOCK
    assert again == first, f"seed {seed}"
    eng.scheduler.kv.pool.check_whole()
    scraped = generate_latest(eng.metrics.registry).decode()
    hits = re.search(r"^mlxd:kv_disk_cache_hit_blocks_total\{[^}]*\} (\S+)$", scraped, re.M)
    assert float(hits.group(1)) == tier.store.totals.hit_blocks
    stats_log = StatsLog(eng.metrics)
    stats_log.maybe_log(0.0, eng.stats(), 1.0)
    assert f"{tier.store.totals.hit_blocks} blocks read back" in stats_log.maybe_log(1.0, eng.stats(), 1.0)


def test_an_adapters_blocks_come_back_for_it_alone(models, tmp_path):
    seed = fresh_seed("lora")
    base = load_model(str(models["dense"]))
    adapter = write_mlx_lm(tmp_path / "adapter", random_adapter(base.model, 4, np.random.default_rng(seed)),
                           scale=2.0, num_layers=2)
    eng = engine(models["dense"], tmp_path / "kv", enable_lora=True, max_lora_rank=4,
                 lora_modules=[f"A={adapter}"])
    prompts = sessions(seed)
    (first, _), (again, cached) = evict_then_return(eng, prompts, lora="A")
    assert cached > 0 and again == first, f"seed {seed}"
    _, base_cached = run(eng, prompts[0], "base")  # the base model's K/V differ: no hit from the adapter's
    assert base_cached == 0
    # Restarted with the same adapter: its blocks are found again (the adapter's key is its content).
    eng.scheduler.kv.release_idle(0.0)
    eng.scheduler.kv.disk.store.flush()
    restarted = engine(models["dense"], tmp_path / "kv", enable_lora=True, max_lora_rank=4,
                       lora_modules=[f"A={adapter}"])
    toks, cached = run(restarted, prompts[0], "c", lora="A")
    assert cached > 0 and toks == first, f"seed {seed}"


def test_files_are_private_and_namespaced_by_the_model(models, tmp_path):
    a = engine(models["dense"], tmp_path / "kv")
    b = engine(models["window"], tmp_path / "kv")
    evict_then_return(a, sessions(1))
    sa, sb = a.scheduler.kv.disk.store, b.scheduler.kv.disk.store
    assert sa.path != sb.path and sb.totals.blocks == 0
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(sa.path).st_mode) == 0o700
    files = [e for e in os.scandir(sa.path) if len(e.name) == 32]
    assert files and all(stat.S_IMODE(e.stat().st_mode) == 0o600 for e in files)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "foreign"])
def test_a_damaged_file_is_recomputed_not_served(models, tmp_path, damage):
    seed = fresh_seed(damage)
    prompts = sessions(seed)
    eng = engine(models["dense"], tmp_path / "kv")
    first = run(eng, prompts[0], "a0")
    for i, p in enumerate(prompts[1:]):
        run(eng, p, f"b{i}")
    store = eng.scheduler.kv.disk.store
    store.flush()
    hashes, parent = [], None
    for i in range(len(prompts[0]) // BLOCK):
        parent = hash_block(parent, prompts[0][i * BLOCK:(i + 1) * BLOCK])
        hashes.append(parent)
    on_disk = [h for h in hashes if store.has(h)]
    assert len(on_disk) >= 2
    bad = store._file(on_disk[1])
    if damage == "flipped":  # one payload byte changed
        with open(bad, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncated":  # a torn write
        with open(bad, "r+b") as f:
            f.truncate(os.path.getsize(bad) // 2)
    else:  # another block's whole, intact file under this block's name
        shutil.copyfile(store._file(on_disk[0]), bad)
    toks, cached = run(eng, prompts[0], "a1")
    assert toks == first[0], f"seed {seed}"
    assert cached <= hashes.index(on_disk[1]) * BLOCK
    assert store.totals.discarded_files == 1
    assert not store.has(on_disk[1]) and not os.path.exists(bad)


def test_the_budget_holds_least_recently_used_out_first(models, tmp_path):
    probe = engine(models["dense"], tmp_path / "probe")
    evict_then_return(probe, sessions(2))
    store = probe.scheduler.kv.disk.store
    per_file = max(store.index.values())
    budget = 10 * per_file
    eng = engine(models["dense"], tmp_path / "kv", budget=budget)
    for i, p in enumerate(sessions(2, n=5)):
        run(eng, p, f"s{i}")
    store = eng.scheduler.kv.disk.store
    store.flush()
    on_disk = sum(e.stat().st_size for e in os.scandir(store.path) if len(e.name) == 32)
    assert store.totals.evicted_blocks > 0
    assert on_disk == store.totals.bytes <= budget


# With steps encoded on a thread of their own (as on CUDA): blocks read back are written into the pools
# on the engine's thread, and no step graph may depend on that thread's stream (MLX's streams are per
# thread; the first GPU run failed with "There is no Stream(gpu, 0) in current thread" here).
@pytest.mark.parametrize("encode_thread", [False, True])
def test_a_new_engine_finds_the_blocks_of_the_last_sessions(models, tmp_path, encode_thread):
    seed = fresh_seed("restart")
    prompt = sessions(seed, n=1)[0]
    kw = dict(async_scheduling=True, encode_thread=True, attention_backend="reference") if encode_thread else {}
    eng = engine(models["dense"], tmp_path / "kv", **kw)
    assert (eng.encoder is not None) == encode_thread
    first, _ = run(eng, prompt, "a0")
    eng.scheduler.kv.release_idle(0.0)  # the engine's first idle moment writes what a restart should find
    eng.scheduler.kv.disk.store.flush()
    del eng
    again = engine(models["dense"], tmp_path / "kv", **kw)
    toks, cached = run(again, prompt, "a1")
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK
    assert toks == first, f"seed {seed}"


def test_an_unusable_folder_turns_the_tier_off_once_and_serving_goes_on(models, tmp_path, caplog):
    (tmp_path / "file").write_text("")
    eng = engine(models["dense"], tmp_path / "file" / "kv")  # a folder that cannot be made
    assert not eng.scheduler.kv.disk.enabled
    assert len(run(eng, sessions(5, n=1)[0], "r0")[0]) == GREEDY.max_tokens

    eng = engine(models["dense"], tmp_path / "kv")
    caplog.clear()
    shutil.rmtree(eng.scheduler.kv.disk.store.path)  # the folder gone while serving (a cleaner, a disk pulled)
    with caplog.at_level(logging.WARNING, logger="mlxd.engine"):
        (first, _), (again, cached) = evict_then_return(eng, sessions(5, n=4))
    assert not eng.scheduler.kv.disk.enabled
    assert len([r for r in caplog.records if "KV disk cache off" in r.getMessage()]) == 1
    assert again == first and cached == 0


def test_the_flags_take_vllm_sizes_and_the_tier_is_off_by_default():
    parse = cli.build_parser().parse_args
    on = build_config(EngineConfig, parse(["serve", "--kv-disk-cache", "--kv-disk-budget", "20GiB"]))
    assert on.kv_disk_cache and on.kv_disk_budget == 20 * 2**30
    assert build_config(EngineConfig, parse(["serve", "--kv-disk-budget", "1.5g"])).kv_disk_budget == 1_500_000_000
    assert not build_config(EngineConfig, parse(["serve"])).kv_disk_cache


def stalled_return(model_dir: str, disk_dir: str, seed: int) -> None:
    """A block file that blocks its reader (a FIFO with no writer, as a stalled network share would): the
    returning request waits out the read timeout, then computes its prefix, and the tier turns off. The
    FIFO is left blocking: run in a process of its own, which must still exit."""
    prompts = sessions(seed)
    eng = engine(model_dir, disk_dir, kv_disk_read_timeout=1.0)
    first = run(eng, prompts[0], "a0")
    for i, p in enumerate(prompts[1:]):
        run(eng, p, f"b{i}")
    store = eng.scheduler.kv.disk.store
    store.flush()
    main = eng.scheduler.kv.disk.parts[0]
    hashes, parent = [], None
    for i in range(len(prompts[0]) // BLOCK):
        parent = hash_block(parent, prompts[0][i * BLOCK:(i + 1) * BLOCK])
        hashes.append(parent)
    # The first block the return reads from disk (the ones before it are still in memory).
    at = next(i for i, h in enumerate(hashes) if not main.in_memory(h))
    assert store.has(hashes[at])
    stalled = store._file(hashes[at])
    os.unlink(stalled)
    os.mkfifo(stalled)
    toks, cached = run(eng, prompts[0], "a1")
    assert toks == first[0]
    assert cached <= at * BLOCK
    assert not store.enabled
    # Serving goes on without the tier.
    assert run(eng, prompts[1], "c0")[0] == run(eng, prompts[1], "c1")[0]
    print("served", flush=True)


def test_a_read_the_disk_never_answers_is_given_up_the_prefix_computed_and_the_engine_still_exits(models, tmp_path):
    seed = fresh_seed("stalled read")
    code = ("import logging, sys; from tests.engined.test_kv_disk import stalled_return; "
            "logging.basicConfig(level=logging.WARNING); stalled_return(*sys.argv[1:3], int(sys.argv[3]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(models["dense"]), str(tmp_path / "kv"), str(seed)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"seed {seed}: the process did not exit with a read stuck on the disk\n{out}{err[-3000:]}")
    assert proc.returncode == 0 and "served" in out, f"seed {seed}\n{out}{err[-3000:]}"
    assert err.count("a read was not back in 1 s") == 1, f"seed {seed}\n{err[-3000:]}"


def test_read_or_recompute_follows_the_measured_rates(models, tmp_path):
    """A lookup reads its blocks back only where reading them is faster than computing them, by the rates
    the engine measured: with recompute measured faster it computes (same tokens, nothing read), else it reads."""
    seed = fresh_seed("rates")
    prompts = sessions(seed, n=4)
    eng = engine(models["dense"], tmp_path / "kv")
    tier = eng.scheduler.kv.disk
    first = run(eng, prompts[0], "a0")
    for i, p in enumerate(prompts[1:]):
        run(eng, p, f"b{i}")
    tier.store.flush()
    assert tier.pays(10**9, 1)  # nothing measured yet (prompts below MIN_PREFILL_SAMPLE): it reads
    # Computing faster than the disk reads: the returning session computes its prefix.
    tier.read_rate, tier.prefill_rate = Rate(1e3), Rate(1e9)
    toks, cached = run(eng, prompts[0], "slow-disk")
    assert toks == first[0] and cached == 0, f"seed {seed}"
    assert tier.store.totals.declined_reads == 1 and tier.store.totals.hit_blocks == 0
    # Evicted again; now the disk is the faster: it reads.
    for i, p in enumerate(prompts[1:]):
        run(eng, p, f"c{i}")
    tier.store.flush()
    declined = tier.store.totals.declined_reads
    tier.read_rate, tier.prefill_rate = Rate(1e12), Rate(1.0)
    toks, cached = run(eng, prompts[0], "fast-disk")
    assert toks == first[0] and cached == (len(prompts[0]) - 1) // BLOCK * BLOCK, f"seed {seed}"
    assert tier.store.totals.hit_blocks > 0 and tier.store.totals.declined_reads == declined
    # The read was measured (asked to installed), and the rule compares bytes over tokens.
    assert tier.read_rate.value < 1e12
    tier.read_rate, tier.prefill_rate = Rate(2e6), Rate(1e3)
    assert tier.pays(1_999_000, 1000) and not tier.pays(2_001_000, 1000)
    # Until a read is measured, the write rate stands in for it.
    tier.read_rate = Rate()
    write_rate = tier.store.totals.bytes_written / tier.store.write_seconds
    assert tier.pays(int(write_rate * 0.9), 1000) and not tier.pays(int(write_rate * 1.1), 1000)


def test_a_finished_prefill_is_a_sample_and_the_rates_outlive_the_engine(models, tmp_path):
    seed = fresh_seed("prefill rate")
    config = EngineConfig(num_kv_blocks=160, block_size=BLOCK, max_num_batched_tokens=256, max_num_seqs=4,
                          kv_disk_cache=True, kv_cache_dir=str(tmp_path / "kv"))
    eng = Engine(config, loaded=load_model(str(models["dense"])))
    tier = eng.scheduler.kv.disk
    prompt = np.random.default_rng(seed).integers(1, 260, size=MIN_PREFILL_SAMPLE + 8).tolist()
    run(eng, prompt, "long")
    assert tier.prefill_rate.value is not None and tier.prefill_rate.value > 0
    tier.read_rate = Rate(5e8)
    measured = tier.prefill_rate.value
    # What an idle moment does (``release_idle`` does it once a pause, and the engine's own steps may
    # have begun this pause before the rates above were set)
    tier.persist()
    again = engine(models["dense"], tmp_path / "kv")
    assert again.scheduler.kv.disk.prefill_rate.value == pytest.approx(measured)
    assert again.scheduler.kv.disk.read_rate.value == pytest.approx(5e8)


def test_a_writer_behind_drops_the_tail_of_a_prefix_not_its_head(models, tmp_path, monkeypatch):
    """The pool evicts a prefix tail first; the writes are queued head first, so a writer that falls
    behind (here: held, with room for a few blocks) keeps what a returning session can use."""
    seed = fresh_seed("writer behind")
    prompts = sessions(seed, n=3)
    eng = engine(models["dense"], tmp_path / "kv")
    tier = eng.scheduler.kv.disk
    room = 5
    monkeypatch.setattr(disk_store, "MAX_PENDING_BYTES", room * tier.parts[0].entry_bytes)
    first = run(eng, prompts[0], "a0")
    held = threading.Event()
    tier.store._worker.submit(held.wait)  # the writer falls behind: nothing is written until it is let go
    for i, p in enumerate(prompts[1:]):
        run(eng, p, f"b{i}")
    held.set()
    tier.store.flush()
    hashes, parent = [], None
    for i in range(len(prompts[0]) // BLOCK):
        parent = hash_block(parent, prompts[0][i * BLOCK:(i + 1) * BLOCK])
        hashes.append(parent)
    on_disk = [i for i, h in enumerate(hashes) if tier.store.has(h)]
    in_memory = [i for i, h in enumerate(hashes) if tier.parts[0].in_memory(h)]
    assert tier.store.totals.dropped_writes > 0 and len(on_disk) == room
    # What the disk kept continues what memory kept (the blocks evicted last), not the prefix's end.
    found = sorted(set(on_disk + in_memory))
    assert found == list(range(len(found))) and len(found) > len(in_memory), (in_memory, on_disk)
    toks, cached = run(eng, prompts[0], "a1")
    assert toks == first[0] and cached == len(found) * BLOCK, f"seed {seed}"


def test_the_benchmarks_evicting_workload_finds_its_sessions_on_disk(models, tmp_path):
    """bench/kv_disk.py's evicting workload, small: every returning session's prefix comes back from disk."""
    from mlxd.bench import kv_disk

    args = argparse.Namespace(sessions=4, context=120, turn_tokens=8, max_tokens=4, pool_sessions=1,
                              concurrency=1, block_size=BLOCK, disk_budget=2**30, kv_cache_dir=str(tmp_path),
                              seed=fresh_seed("bench"), make_loaded=lambda: load_model(str(models["dense"])))
    times, cached, tokens = kv_disk.returning(260, args, tier=True, restart=False)
    _, cached_off, tokens_off = kv_disk.returning(260, args, tier=False, restart=False)
    assert cached == [args.context // BLOCK * BLOCK] * args.sessions and cached_off == [0] * args.sessions
    assert tokens == tokens_off, f"seed {args.seed}"
