"""Scheduler + block pool invariants under random arrivals, aborts, preemptions and finishes.

No model runs here: a step "computes" what the scheduler scheduled and hands
the scheduler's own ``postprocess`` a sampled token for every request whose
known tokens are all computed, as the engine does.
"""

import random

import numpy as np
from hypothesis import given, settings, strategies as st

from mlxd.engined.kv.manager import KVCacheManager
from mlxd.engined.request import Request, Status
from mlxd.engined.scheduler import Scheduler, SchedulerOutput, attended_keys
from mlxd.shared.protocol import SamplingParams
from tests.tiny_models import fresh_seed

blocks_only = KVCacheManager.blocks_only


def sample_tokens(out: SchedulerOutput, rng: random.Random) -> dict:
    """What the engine's sampler hands postprocess: one token for each request that yields logits."""
    return {req: ([rng.randrange(1, 50)], [None]) for (req, _), k in zip(out.scheduled, out.num_logits) if k}


def complete(sched: Scheduler, out: SchedulerOutput, rng: random.Random) -> list:
    """The step ran: advance it, then hand postprocess its sampled tokens (as the engine does)."""
    emitted = sample_tokens(out, rng)
    sched.advance(out)
    return sched.postprocess(out, emitted)


def check_invariants(sched: Scheduler, kv: KVCacheManager, out, budget: int, max_seqs: int):
    assert out.num_tokens <= budget
    assert len(sched.running) <= max_seqs
    assert all(n >= 1 for _, n in out.scheduled)
    held = {}
    for rid, blocks in kv.req_blocks.items():
        for b in blocks:
            held[b.block_id] = held.get(b.block_id, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_count == held.get(block.block_id, 0), "reference count disagrees with holders"
        assert (block.ref_count == 0) == (block.block_id in kv.pool.free_queue)
    for req in sched.running:
        assert len(kv.req_blocks[req.request_id]) * kv.block_size >= req.num_computed_tokens
    for req, n in out.scheduled:
        assert len(kv.req_blocks[req.request_id]) * kv.block_size >= req.num_computed_tokens + n
    running_ids = {r.request_id for r in sched.running}
    assert set(kv.req_blocks) <= running_ids


def simulate(seed, num_blocks, block_size, budget, max_seqs, caching, n_requests, abort_rate, chunk_align=1):
    rng = random.Random(seed)
    kv = blocks_only(num_blocks, block_size, caching)
    sched = Scheduler(kv, max_seqs, budget, chunk_align=chunk_align)
    # Shared system prompts make prefix hits (and shared blocks) likely.
    systems = [[rng.randrange(1, 50) for _ in range(rng.randrange(0, 3 * block_size))] for _ in range(3)]
    pending = []
    for i in range(n_requests):
        # Only requests the engine admits (prompt + max_tokens fit the whole pool) reach the scheduler.
        capacity = num_blocks * block_size
        max_tokens = rng.randrange(1, min(20, capacity))
        prompt = (rng.choice(systems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 40))])
        prompt = prompt[: capacity - max_tokens]
        pending.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), seed=i,
                               app=rng.choice(["", "a", "b"]), priority=rng.choice([0, 0, 1])))
    live: dict[str, Request] = {}
    steps = 0
    while pending or live:
        steps += 1
        assert steps < 5000, "no progress: scheduler deadlocked"
        for _ in range(rng.randrange(0, 3)):
            if pending:
                req = pending.pop(0)
                live[req.request_id] = req
                sched.add(req)
        if live and rng.random() < abort_rate:
            victim = live.pop(rng.choice(sorted(live)))
            sched.finish(victim, "abort")
        out = sched.schedule()
        check_invariants(sched, kv, out, budget, max_seqs)
        for req, _ in complete(sched, out, rng):
            if req.finished:
                assert req.finish_reason == "length" and req.num_output_tokens == req.params.max_tokens
                del live[req.request_id]
        if not out.scheduled:
            # Nothing ran: only possible when nothing is left to run.
            assert not sched.running and not sched.waiting
    assert not sched.has_unfinished()
    kv.pool.check_whole()
    return sched


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 96),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    n_requests=st.integers(1, 25),
    abort_rate=st.sampled_from([0.0, 0.1, 0.4]),
    chunk_align=st.sampled_from([1, 8]),
)
def test_scheduler_never_exceeds_budgets_and_never_leaks_blocks(
    seed, num_blocks, block_size, budget, max_seqs, caching, n_requests, abort_rate, chunk_align
):
    simulate(seed, num_blocks, block_size, budget, max_seqs, caching, n_requests, abort_rate, chunk_align)


def test_scheduler_preempts_newest_when_pool_is_tight():
    # Two requests that each grow past half the pool: one must be preempted and recomputed.
    kv = blocks_only(4, 4, False)
    s = Scheduler(kv, 4, 64)
    a = Request("a", list(range(1, 8)), SamplingParams(max_tokens=8), 0)
    b = Request("b", list(range(1, 8)), SamplingParams(max_tokens=8), 1)
    s.add(a)
    s.add(b)
    _, preempted = drain(s, kv)
    assert preempted and preempted[0] == "b", "the newest running request is the one preempted"
    assert a.finished and b.finished


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget():
    kv = blocks_only(64, 16, False)
    s = Scheduler(kv, 8, 32)
    long = Request("long", list(range(1, 101)), SamplingParams(max_tokens=1), 0)
    s.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = s.schedule()
        (req, n), = out.scheduled
        chunks.append(n)
        req.num_computed_tokens += n
    assert chunks == [32, 32, 32, 4]


def test_a_prefill_cut_short_ends_on_the_chunk_alignment():
    """CUDA's scheduler (chunk_align = the SDPA bucket): a prompt the budget cuts ends its chunk on a
    multiple of the alignment, so the next chunk starts on one; a chunk too short to reach one stays."""
    kv = blocks_only(256, 16, False)
    s = Scheduler(kv, 8, 600, chunk_align=256)
    a = Request("a", list(range(1, 301)), SamplingParams(max_tokens=4), 0)
    b = Request("b", list(range(1, 1001)), SamplingParams(max_tokens=4), 1)
    s.add(a)
    s.add(b)
    steps = []
    while b.num_computed_tokens < b.num_prompt_tokens:
        out = s.schedule()
        steps.append([(req.request_id, n) for req, n in out.scheduled])
        s.advance(out)
        s.postprocess(out, sample_tokens(out, random.Random(0)))
    # b: 300 fit beside a's whole prompt, cut to 256; then chunks within the attention budget that a's
    # decoding sets, each cut to end on a multiple of 256 unless it falls short of the next one
    assert steps[0] == [("a", 300), ("b", 256)]
    ends = np.cumsum([n for step in steps for rid, n in step if rid == "b"])
    starts = np.concatenate([[0], ends[:-1]])
    assert ends[-1] == 1000 and len(ends) > 3, steps
    assert ((ends[:-1] % 256 == 0) | (ends[:-1] // 256 == starts[:-1] // 256)).all(), steps
    assert (ends[:-1] % 256 == 0).sum() >= 3, steps
    s2 = Scheduler(blocks_only(256, 16, False), 8, 100, chunk_align=256)
    c = Request("c", list(range(1, 401)), SamplingParams(max_tokens=1), 0)
    s2.add(c)
    assert [n for _, n in s2.schedule().scheduled] == [100]  # short of the first multiple: no cut


def test_abort_frees_blocks_in_the_same_step():
    kv = blocks_only(16, 4, True)
    s = Scheduler(kv, 8, 64)
    req = Request("x", list(range(1, 30)), SamplingParams(max_tokens=4), 0)
    s.add(req)
    s.schedule()
    assert kv.num_free_blocks < 16
    s.finish(req, "abort")
    assert req.status is Status.FINISHED
    kv.pool.check_whole()


def test_prefix_hit_shares_blocks_and_skips_computed_tokens():
    kv = blocks_only(32, 4, True)
    s = Scheduler(kv, 8, 64)
    first = Request("a", list(range(1, 18)), SamplingParams(max_tokens=1), 0)
    s.add(first)
    out = s.schedule()
    first.num_computed_tokens += out.scheduled[0][1]
    kv.commit(first)
    second = Request("b", list(range(1, 18)) + [40, 41], SamplingParams(max_tokens=1), 1)
    s.add(second)
    out = s.schedule()
    scheduled = dict((r.request_id, n) for r, n in out.scheduled)
    assert second.num_cached_tokens == 16  # four full blocks of the 17-token prefix
    assert scheduled["b"] == 19 - 16
    shared = kv.req_blocks["a"][:4]
    assert kv.req_blocks["b"][:4] == shared and all(b.ref_count == 2 for b in shared)


def drain(sched, kv, max_steps=400):
    """Run the simulated loop to the end; returns (ids in first-admission order, ids preempted)."""
    admitted, preempted = [], []
    rng = random.Random(0)
    for _ in range(max_steps):
        out = sched.schedule()
        preempted += [r.request_id for r in out.preempted]
        for req, _ in out.scheduled:
            if req.request_id not in admitted:
                admitted.append(req.request_id)
        complete(sched, out, rng)
        if not sched.has_unfinished():
            break
    kv.pool.check_whole()
    return admitted, preempted


def test_an_app_flooding_the_queue_cannot_starve_another():
    kv = blocks_only(256, 4, False)
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    flood = [Request(f"a{i}", [1, 2, 3], SamplingParams(max_tokens=4), i, app="flooder") for i in range(20)]
    late = Request("b0", [1, 2, 3], SamplingParams(max_tokens=4), 99, app="polite")
    for r in flood:
        s.add(r)
    s.schedule()  # the flooder fills both running slots first
    s.add(late)
    order, _ = drain(s, kv)
    # The polite app's only request runs as soon as a slot frees, ahead of 18 queued flood requests.
    assert order.index("b0") <= 2, order


def test_lower_priority_value_is_admitted_first_and_preempted_last():
    kv = blocks_only(256, 4, False)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    for i, prio in enumerate([5, 5, 0, 1]):
        s.add(Request(f"p{prio}-{i}", [1, 2, 3], SamplingParams(max_tokens=2), i, priority=prio))
    assert drain(s, kv)[0] == ["p0-2", "p1-3", "p5-0", "p5-1"]
    # Under memory pressure the low-priority (high value) request is the one preempted.
    kv = blocks_only(4, 4, False)
    s = Scheduler(kv, 4, 64)
    important = Request("important", list(range(1, 8)), SamplingParams(max_tokens=8), 0, priority=0)
    casual = Request("casual", list(range(1, 8)), SamplingParams(max_tokens=8), 1, priority=9)
    s.add(casual)
    s.schedule()
    s.add(important)
    _, preempted = drain(s, kv)
    assert preempted and set(preempted) == {"casual"}
    assert important.finished and casual.finished


def test_recycled_blocks_let_gpu_prefill_read_the_cache_in_place():
    """A wave of prompts that reuses a finished wave's blocks gets each run back consecutive and
    ascending, evenly spaced in a batch: the Metal route's in-place condition, no gather."""
    rng = random.Random(fresh_seed())
    bs, n, length = 16, 4, 160
    kv = blocks_only(n * length // bs, bs, True)

    def wave(tag):
        reqs = [Request(f"{tag}{i}", [rng.randrange(1, 1001) for _ in range(length)],
                        SamplingParams(max_tokens=1), seed=i) for i in range(n)]
        for req in reqs:
            assert kv.allocate(req, length, kv.cached_prefix(req))
        return reqs

    first = wave("a")
    for req in first:  # computed and cached, then finished: freed tail first, queued in reverse
        req.num_computed_tokens = length
        kv.commit(req)
        kv.free(req)
    second = wave("b")
    tables = [kv.block_ids(r.request_id).tolist() for r in second]
    # Request i holds blocks 10i .. 10i + 9: each run consecutive, the runs evenly spaced from block 0.
    per = length // bs
    assert tables == [list(range(i * per, (i + 1) * per)) for i in range(n)]


def test_a_long_prefill_beside_decoding_streams_attends_a_bounded_number_of_keys_per_step():
    """A 7K-token prompt joins three decoding streams: every step still decodes each stream, and the
    keys its prefill chunks attend stay within a full first chunk's, however long the prefix grows."""
    rng = random.Random(fresh_seed("long-prefill"))
    budget, block = 1024, 16
    kv = blocks_only(1024, block, False)
    sched = Scheduler(kv, 8, budget, 8192)
    streams = [Request(f"s{i}", [rng.randrange(1, 50) for _ in range(30)], SamplingParams(max_tokens=2000,
                                                                                         ignore_eos=True), seed=i)
               for i in range(3)]
    for req in streams:
        sched.add(req)
    complete(sched, out := sched.schedule(), rng)  # their prefills: all now decode
    long = Request("long", [rng.randrange(1, 50) for _ in range(7000)], SamplingParams(max_tokens=4), seed=9)
    sched.add(long)
    steps, largest = 0, 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        steps += 1
        out = sched.schedule()
        check_invariants(sched, kv, out, budget, 8)
        rows = dict(out.scheduled)
        assert all(rows.get(s) == 1 for s in streams), f"a decoding stream missed step {steps}"
        keys = attended_keys(long.num_computed_tokens, rows[long]) if long in rows else 0
        largest = max(largest, keys)
        assert keys <= sched.prefill_attention_budget
        complete(sched, out, rng)
    # Total work is the prompt's own causal attention; the step count follows from it (no stalling).
    total = attended_keys(0, 7000)
    assert steps <= total // sched.prefill_attention_budget + 7000 // budget + 2
    print(f"7000-token prefill beside 3 streams: {steps} steps, largest step {largest} keys "
          f"(budget {sched.prefill_attention_budget}; an unbounded last chunk attends {attended_keys(5976, 1024)})")


def test_a_prefill_alone_takes_full_chunks():
    kv = blocks_only(1024, 16, False)
    sched = Scheduler(kv, 8, 1024, 8192)
    long = Request("long", list(range(1, 7001)), SamplingParams(max_tokens=1), seed=0)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sched.schedule()
        chunks.append(dict(out.scheduled)[long])
        complete(sched, out, random.Random(0))
    assert chunks == [1024] * 6 + [7000 - 6 * 1024]


def test_a_long_prefill_spending_the_attention_budget_does_not_hold_new_requests_back():
    kv = blocks_only(1024, 16, False)
    sched = Scheduler(kv, 8, 1024, 8192)
    rng = random.Random(0)
    stream = Request("stream", [1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True), seed=0)
    sched.add(stream)
    complete(sched, out := sched.schedule(), rng)
    long = Request("long", list(range(1, 7001)), SamplingParams(max_tokens=1), seed=1)
    sched.add(long)
    for _ in range(5):  # its prefix grows past the point where one chunk spends the whole budget
        complete(sched, out := sched.schedule(), rng)
    shorts = [Request(f"short{i}", [5 + i] * 300, SamplingParams(max_tokens=1), seed=2 + i) for i in range(2)]
    for short in shorts:
        sched.add(short)
    rows = dict(sched.schedule().scheduled)
    assert rows[stream] == 1 and rows[long] >= 16 and all(rows.get(s, 0) >= 16 for s in shorts)
