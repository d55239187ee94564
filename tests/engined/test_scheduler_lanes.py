"""The scheduler's lanes (pipeline parallelism's batches in flight) with no model: each lane's
batch holds its own requests only, a lane admits only while it runs the fewest, and preemption stays in
the lane scheduled, under random prompts and a pool small enough to preempt.

Steps go as ``Engine._step_lanes`` runs them: a batch is scheduled for every lane with none
out, then the oldest is advanced and postprocessed (its tokens read) before its lane is
scheduled again.
"""

import random
from collections import deque

from mlxd.engined.kv.manager import KVCacheManager
from mlxd.engined.request import Request
from mlxd.engined.scheduler import Scheduler
from mlxd.shared.protocol import SamplingParams
from tests.engined.test_scheduler import check_invariants, complete
from tests.tiny_models import fresh_seed


def test_lanes_batch_their_own_requests_evenly_and_preempt_within_the_lane():
    seed = fresh_seed("lanes")
    rng = random.Random(seed)
    lanes, budget, max_seqs = 3, 64, 12
    kv = KVCacheManager.blocks_only(24, 8, True)
    sched = Scheduler(kv, max_seqs, budget, num_lanes=lanes)
    for i in range(20):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(4, 40))]
        sched.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(4, 30), ignore_eos=True), i))
    out, preempted, most = deque(), 0, 0
    for _ in range(2000):
        busy = {lane for lane, _ in out}
        for lane in range(lanes):
            if lane in busy:
                continue
            before = set(sched.running)
            batch = sched.schedule(lane=lane)
            in_flight = {r for _, b in out for r, _ in b.scheduled}
            assert all(r.lane == lane for r, _ in batch.scheduled)
            assert not in_flight & {r for r, _ in batch.scheduled}, "a request in two batches in flight"
            assert all(v.lane == lane for v in batch.preempted), "a victim from another lane"
            assert not in_flight & set(batch.preempted), "a request preempted while its batch is out"
            preempted += len(batch.preempted)
            check_invariants(sched, kv, batch, budget, max_seqs)
            counts = [sum(r.lane == i for r in sched.running) for i in range(lanes)]
            if any(r not in before for r, _ in batch.scheduled):  # it admitted: it ran the fewest until then
                assert counts[lane] <= min(c for i, c in enumerate(counts) if i != lane) + 1, counts
            if batch.scheduled:
                out.append((lane, batch))
        most = max(most, len(out))
        if not out:
            break
        complete(sched, out.popleft()[1], rng)
    print(f"seed {seed}: {preempted} preemptions, at most {most} batches out")
    assert not sched.has_unfinished()
    assert most == lanes and preempted > 0
