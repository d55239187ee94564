"""Continuous batching with vLLM V1 semantics.

Each step has one token budget (``max_num_batched_tokens``) and a cap on
running sequences (``max_num_seqs``). Running requests go first: a decode
takes one token, an unfinished prefill takes its next chunk. Waiting requests
are admitted only while their blocks can be allocated. While any request is
decoding, prefill chunks also share a budget of attended keys (see
``prefill_attention_budget``), so a long prompt's late chunks, which attend
its whole prefix, cost the decoding streams no more than its first chunk. When a running request
cannot grow, the newest running request is preempted: its blocks are freed and
it is recomputed later from its prompt and the tokens it already generated.

``advance`` counts a launched step's tokens as computed; ``postprocess`` takes
its sampled tokens back later: it appends them, decides whether each request
stops, and commits or frees its KV. Between the two (asynchronous scheduling)
a request's sampled token is a placeholder (``Request.num_placeholders``): the
next step is scheduled as if it were known, and the runner feeds it from the
device. Draft tokens (speculative decoding) are lookahead the scheduler only
budgets: ``schedule(drafts)`` keeps what fits and ``postprocess`` counts what
was accepted.

Lanes (pipeline parallelism, vLLM's virtual engines): with ``num_lanes`` > 1
each running request belongs to one lane and ``schedule(lane=i)`` builds a
batch of lane i's requests only, so a lane's batch can be in flight down the
pipeline while another lane's is scheduled. A waiting request joins the lane
being scheduled while that lane runs the fewest requests; preemption picks
victims in the same lane.

The scheduler allocates through its KV cache manager (``engined.kv.manager``):
admission is an allocation that succeeds or waits.

Over 400 lines because admission, chunked prefill under the attention budget, preemption, fair
share between apps and the pipeline's lanes are one policy over the same two queues, each deciding
which request runs next.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from mlxd.engined.kv.manager import KVCacheManager
from mlxd.engined.request import Request, Status
from mlxd.shared.errors import InvalidRequestError
from mlxd.shared.protocol import EngineStats, Logprob


@dataclass
class SchedulerOutput:
    # (request, number of its tokens computed this step: known ones, then its drafts), in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Draft tokens a speculating request computes after its known ones (those that fit the budget).
    drafts: dict[Request, list[int]] = field(default_factory=dict)
    # Requests whose grammar raised on a sampled token in ``postprocess``, with the exception:
    # they are the engine's to fail (alone), neither advanced further nor finished here.
    failed: list[tuple[Request, Exception]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_logits(self) -> list[int]:
        """Rows needing logits per scheduled request: none for a prefill chunk short of the end,
        the last row otherwise, plus one per draft token; an embed request's last row needs
        its hidden state instead (``hidden_rows``), not logits."""
        return [len(self.drafts.get(r, ())) + 1 if r.num_computed_tokens + n >= r.num_tokens_with_placeholders
                and r.task != "embed" else 0 for r, n in self.scheduled]

    @property
    def hidden_rows(self) -> list[int]:
        """Per scheduled request, 1 where its last row's final hidden state is its result (an
        embed request's last chunk), else 0."""
        return [int(r.task == "embed" and r.num_computed_tokens + n >= r.num_tokens) for r, n in self.scheduled]


def attended_keys(context: int, n: int) -> int:
    """Keys ``n`` new query rows attend after ``context`` computed tokens (causally: each also sees those before it)."""
    return n * context + n * (n + 1) // 2


def chunk_within(context: int, keys: int) -> int:
    """The largest ``n`` with ``attended_keys(context, n) <= keys``."""
    b = 2 * context + 1
    n = (math.isqrt(b * b + 8 * keys) - b) // 2
    return n + 1 if attended_keys(context, n + 1) <= keys else n


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, eos_token_ids: tuple[int, ...] = (), lora=None,
                 num_lanes: int = 1, chunk_align: int = 1):
        self.kv = kv
        self.num_lanes = num_lanes
        # engined.lora.LoraRegistry, or None: a request under an adapter runs only while it holds a slot.
        self.lora = lora
        self.lora_failures: list[tuple[Request, InvalidRequestError]] = []
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Attended keys all prefill chunks of one step may add while a request decodes: those of
        # a first chunk of a full budget. Attention cost grows with the context a chunk reads, so a
        # token budget alone let a 7K-token prompt's late chunks stall every stream for seconds.
        self.prefill_attention_budget = attended_keys(0, max_num_batched_tokens)
        # The least a prefill advances per step however long its prefix (progress, whatever the budget).
        self.min_prefill_chunk = kv.block_size
        # A prefill cut short ends on a multiple of this where it can, so that its next chunk starts on
        # one: CUDA's SDPA pads chunks to shape buckets, which a continued chunk meets only so aligned.
        self.chunk_align = chunk_align

    def stats(self) -> EngineStats:
        """The queues and the main pool (the daemon adds its step and socket times)."""
        kv = self.kv
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.pool.num_blocks,
                           num_preemptions=self.num_preemptions, prefix_cache_queries=kv.queries,
                           prefix_cache_hits=kv.hits)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens fits the whole main pool (else it could never run)."""
        return self.kv.blocks_for(num_tokens) <= self.kv.pool.num_blocks

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: dict[Request, list[int]] | None = None, lane: int = 0) -> SchedulerOutput:
        """This step's batch (of ``lane``'s requests); ``drafts`` are tokens proposed after running
        requests' known ones."""
        out = SchedulerOutput()
        drafts = drafts or {}
        budget = self.max_num_batched_tokens

        # Running requests first, best priority and oldest first; preempt from the other end.
        self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        mine = self._lane(lane)
        fair_preempted = self._make_room_for_starved_apps(mine)
        out.preempted += fair_preempted
        # None: nothing decodes, prefills take the whole token budget.
        keys = (self.prefill_attention_budget
                if any(r.num_tokens_with_placeholders - r.num_computed_tokens == 1 for r in mine) else None)
        i = 0
        while i < len(mine) and budget > 0:
            req = mine[i]
            if req.num_placeholders and self._ends_on_placeholder(req):
                i += 1  # it stops on the token still on the device: a step more would be thrown away
                continue
            known = req.num_tokens_with_placeholders - req.num_computed_tokens
            if not known:  # a pooled request whose whole prompt is in the step in flight
                i += 1
                continue
            draft = drafts.get(req, ())
            num_new = min(known + len(draft), budget)
            if known > 1:  # a prefill: within the attention budget while others decode, then aligned
                if keys is not None:
                    num_new = self._prefill_chunk(req.num_computed_tokens, num_new, keys)
                num_new = self._aligned(req.num_computed_tokens, num_new, known)
                if keys is not None:
                    keys -= attended_keys(req.num_computed_tokens, num_new)
            while not self.kv.allocate(req, num_new):
                victim = mine.pop()
                if mine is not self.running:
                    self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                if num_new > known:  # drafts that don't fit the budget are dropped, never the known tokens
                    out.drafts[req] = list(draft[: num_new - known])
                budget -= num_new
                i += 1

        # Admit waiting requests only if no running request had to be preempted to grow.
        pressure = len(out.preempted) > len(fair_preempted)
        # Stepped over this step (later ones may still run): their adapter found every slot held, or
        # their cached blocks are being read from disk.
        no_slot: set[Request] = set()
        while budget > 0 and not pressure and len(self.running) < self.max_num_seqs and self._fewest(mine):
            req = self._next_waiting(no_slot)
            if req is None:
                break
            if self.kv.reading(req):
                no_slot.add(req)
                continue
            if not self._take_lora_slot(req):
                no_slot.add(req)
                continue
            prefix = self.kv.cached_prefix(req) if req.num_computed_tokens == 0 else []
            cached = len(prefix) * self.kv.block_size
            num_new = min(req.num_tokens - req.num_computed_tokens - cached, budget)
            context = req.num_computed_tokens + cached
            if keys is not None and num_new > 1:
                num_new = self._prefill_chunk(context, num_new, keys)
            num_new = self._aligned(context, num_new, req.num_tokens - context)
            if not self.kv.allocate(req, num_new, prefix):
                self._drop_lora_slot(req)
                break
            if keys is not None and num_new > 1:
                keys -= attended_keys(context, num_new)
            self.waiting.remove(req)
            if req.num_output_tokens == 0:  # first admission, not a resumption after preemption
                req.num_cached_tokens = cached
                if self.kv.enable_caching:
                    self.kv.record_lookup(req.num_tokens, cached)
            req.num_computed_tokens += cached
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.lane = lane
            self.running.append(req)
            if mine is not self.running:
                mine.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        return out

    def _lane(self, lane: int) -> list[Request]:
        """The running requests of ``lane``: all of them (the list itself) when there is one lane."""
        return self.running if self.num_lanes == 1 else [r for r in self.running if r.lane == lane]

    def _fewest(self, mine: list[Request]) -> bool:
        """Whether the lane of running requests ``mine`` may admit one more: no other lane runs fewer."""
        if self.num_lanes == 1:
            return True
        counts = [0] * self.num_lanes
        for r in self.running:
            counts[r.lane] += 1
        return len(mine) <= min(counts)

    def _prefill_chunk(self, context: int, num_new: int, keys: int) -> int:
        """A prefill chunk of at most ``num_new`` tokens within ``keys`` attended keys.

        Every prefill still advances by ``min_prefill_chunk`` however little is
        left, so a long prompt that spends the budget step after step cannot hold
        new requests back: a step attends at most the budget plus a minimal chunk
        per prefill.
        """
        return min(num_new, max(chunk_within(context, max(keys, 0)), self.min_prefill_chunk))

    def _aligned(self, context: int, num_new: int, remaining: int) -> int:
        """``num_new``, or less so that a chunk short of the ``remaining`` tokens ends on a multiple of
        ``chunk_align`` (unless that would leave it nothing to do)."""
        if num_new >= remaining or self.chunk_align <= 1:
            return num_new
        end = (context + num_new) // self.chunk_align * self.chunk_align
        return end - context if end > context else num_new

    def _make_room_for_starved_apps(self, mine: list[Request]) -> list[Request]:
        """Preempt over-share apps' newest requests for waiting apps below their share.

        Each app with work is due ``max_num_seqs // active apps`` running slots.
        Admission order alone would make a second app wait for a flooding
        app's requests to finish; this hands it its slots (and blocks) within a
        step. Fairness never overrides priority, and an app at or under its
        share is never preempted for another. Victims come from ``mine`` (the lane scheduled).
        """
        if not self.waiting or not self.running:
            return []
        counts: dict[str, int] = {}
        for r in self.running:
            counts[r.app] = counts.get(r.app, 0) + 1
        ready = [r for r in self.waiting if r.ready]
        share = max(1, self.max_num_seqs // len(set(counts) | {r.app for r in ready}))
        free_slots = self.max_num_seqs - len(self.running)
        free_blocks = self.kv.num_free_blocks
        victims = []
        for req in ready:
            if counts.get(req.app, 0) >= share:
                continue
            need = self.kv.blocks_for(req.num_tokens)
            if free_slots > 0 and need <= free_blocks:
                free_slots, free_blocks = free_slots - 1, free_blocks - need  # admission will find room
                counts[req.app] = counts.get(req.app, 0) + 1
                continue
            busiest = max(counts, key=counts.get)
            if counts[busiest] <= share:
                break
            victim = next((r for r in reversed(mine) if r.app == busiest and r.priority >= req.priority), None)
            if victim is None:
                continue
            held = len(self.kv.req_blocks.get(victim.request_id, ()))
            self.running.remove(victim)
            if mine is not self.running:
                mine.remove(victim)
            self._preempt(victim)
            victims.append(victim)
            counts[busiest] -= 1
            counts[req.app] = counts.get(req.app, 0) + 1
            free_blocks += held - need
        return victims

    def _take_lora_slot(self, req: Request) -> bool:
        if req.lora_name is None or self.lora is None:
            return True
        try:
            slot = self.lora.acquire(req.lora_name)
        except InvalidRequestError as e:  # its adapter's files could not be read again: it fails alone
            self.lora_failures.append((req, e))
            return False
        req.lora_slot = slot or 0
        return slot is not None

    def take_lora_failures(self) -> list[tuple[Request, InvalidRequestError]]:
        """Waiting requests whose adapter could not be put in a slot since the last call: the engine fails them."""
        failed, self.lora_failures = self.lora_failures, []
        return failed

    def _drop_lora_slot(self, req: Request) -> None:
        if req.lora_slot:
            self.lora.release(req.lora_slot)
            req.lora_slot = 0

    def _next_waiting(self, skip=()) -> Request | None:
        """The waiting request to admit next: best priority, then the app with the fewest running, then queue order.

        Fair share: an app flooding the queue gets its next turn only after the
        apps with fewer running requests got theirs. Requests whose grammar is
        still compiling are stepped over, keeping their place.
        """
        running_per_app: dict[str, int] = {}
        for r in self.running:
            running_per_app[r.app] = running_per_app.get(r.app, 0) + 1
        best, best_key = None, None
        for pos, req in enumerate(self.waiting):
            if not req.ready or req in skip:
                continue
            key = (req.priority, running_per_app.get(req.app, 0), pos)
            if best_key is None or key < best_key:
                best, best_key = req, key
        return best

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self._drop_lora_slot(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request, reason: str) -> None:
        """Take a request out of the queues and free its blocks (finish or abort)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.kv.free(req)
        self._drop_lora_slot(req)

    def _ends_on_placeholder(self, req: Request) -> bool:
        """Whether the request's token still on the device is its last (max_tokens, or the context full)."""
        return (req.output_position >= req.params.max_tokens
                or (self.max_model_len is not None and req.num_tokens_with_placeholders >= self.max_model_len))

    # -- after the step -----------------------------------------------------------------------

    def advance(self, out: SchedulerOutput) -> None:
        """The step is launched: its known tokens count as computed (their K/V is being written),
        and each request that samples holds a placeholder for its token until ``postprocess``."""
        for (req, n), k in zip(out.scheduled, out.num_logits):
            req.num_computed_tokens += n - len(out.drafts.get(req, ()))
            if k and not req.pooled:
                req.num_placeholders += 1

    def postprocess(self, out: SchedulerOutput,
                    emitted: dict[Request, tuple[list[int], list[Logprob | None]]]) -> list[tuple[Request, int]]:
        """Take the step's new tokens back (after ``advance``): append, stop, then commit or free the KV.

        ``emitted[req]`` holds the tokens (and Logprob records or Nones) a
        request produced: one sampled token, or its accepted drafts and the
        next token. A request that finished or was aborted while the step ran
        is passed over; one preempted meanwhile takes its token and waits.
        Returns the requests that produced tokens with how many; a request
        whose grammar raised is left in ``out.failed`` instead.
        """
        produced = []
        for req, n in out.scheduled:
            if req.finished:
                continue
            new = emitted.get(req)
            if new is None:  # a prefill chunk short of the end, or a pooled request's whole prompt
                self._commit(req)
                if req.pooled and (req.embedding is not None or req.score is not None):
                    # Its result is on the request (the engine put it there when this step was
                    # read; with a later chunk in flight, computed tokens alone would say so too
                    # early): done, KV freed (blocks the prefix cache hashed stay cached).
                    self.finish(req, "stop")
                    produced.append((req, 0))
                continue
            tokens, lps = new
            req.num_placeholders -= 1
            # The accepted drafts (all but the last token) now have their K/V in the cache too.
            req.num_computed_tokens += len(tokens) - 1
            reason = None
            for token, lp in zip(tokens, lps):
                req.token_ids.append(token)
                req.pending_tokens.append(token)
                if lp is not None:
                    req.pending_logprobs.append(lp)
                reason = self._stop_reason(req, token)
                if req.grammar is not None and not reason:
                    try:
                        reason = req.grammar.accept(token)
                    except Exception as e:  # this request's matcher broke: it alone fails
                        out.failed.append((req, e))
                        break
                if reason:
                    break
            if out.failed and out.failed[-1][0] is req:
                continue
            if reason:
                self.finish(req, reason)
            else:
                self._commit(req)
            produced.append((req, len(tokens)))
        return produced

    def _commit(self, req: Request) -> None:
        # A request preempted while its step ran holds no blocks to commit.
        if req.status is Status.RUNNING:
            self.kv.commit(req)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        # The sampler masks stop tokens until min_tokens are out, so a stop token here is final.
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            req.stop_token_id = token
            return "stop"
        if req.num_output_tokens >= p.max_tokens or (
                self.max_model_len is not None and req.num_tokens >= self.max_model_len):
            return "length"
        return None
