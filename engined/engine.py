"""The in-process engine: requests in, token ids out, one packed step at a time.

    schedule -> run the packed forward -> sample -> update requests -> outputs

The daemon wraps this object; tests and benchmarks use it directly.
"""

from __future__ import annotations

import logging
import os
import random
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

import mlx.core as mx
from mlx.utils import tree_flatten

import kernels
from engined import memory_guard
from engined.metrics import EngineMetrics
from engined.loaders import LoadedModel, load_model
from engined.request import Request
from engined.runner import ModelRunner
from engined.model_kinds import make_kv_manager, make_runner
from engined.sampler import Sampler, logprobs_for
from engined.scheduler import Scheduler, SchedulerOutput
from engined.structured import GrammarCompiler
from engined.speculative import DraftProposer, Speculator
from shared.config import EngineConfig, SpeculativeConfig
from shared.errors import ContextLengthError, InvalidRequestError, ModelLoadError, OverloadedError
from shared.protocol import EngineStats, ModelInfo, RequestOutput
from shared.sampling import SamplingParams

log = logging.getLogger("mlxd.engine")


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, progress: bool = False):
        self.config = config
        loaded = loaded or load_model(config.model, config.dtype)
        self.loaded = loaded
        self.max_model_len = config.max_model_len or loaded.context_length
        dtype = next(
            (p.dtype for _, p in tree_flatten(loaded.model.parameters()) if mx.issubdtype(p.dtype, mx.floating)),
            mx.float32,
        )
        self.runner = make_runner(loaded.model, config, loaded.num_kv_heads, loaded.head_dim, dtype)
        self.sampler = Sampler(loaded.vocab_size, loaded.eos_token_ids)
        self.metrics = EngineMetrics(config.served_model_name or loaded.model_id, config.metrics_prefix)
        spec = config.speculative
        self.drafter = self._load_drafter(spec, loaded, dtype) if spec and spec.method == "draft_model" else None
        self.speculator = Speculator(spec, self.sampler, self.drafter, self.metrics) if spec else None
        runners = [self.runner] + ([self.drafter.runner] if self.drafter else [])
        self.memory = memory_guard.plan(
            self.runner, config, self.max_model_len, loaded.vocab_size,
            sum(r.bytes_per_block for r in runners), progress,
        )
        log.info("%s", self.memory.describe())
        num_blocks = self.memory.num_blocks
        attention_backend = kernels.resolve_backend(config.attention_backend)
        for runner in runners:
            runner.allocate_kv(num_blocks)
            runner.ctx.attention_backend = attention_backend
        self.kv = make_kv_manager(self.runner, num_blocks, config)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._seeds = random.Random(config.seed)
        self._aborted: list[RequestOutput] = []
        # Requests whose grammar is compiling, and those whose grammar failed (id, error).
        self._compiling: list[Request] = []
        self._failed: list[tuple[str, InvalidRequestError]] = []
        self.info = ModelInfo(
            model_id=loaded.model_id,
            served_model_name=config.served_model_name or loaded.model_id,
            tokenizer_dir=str(loaded.tokenizer_dir),
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_kv_blocks=num_blocks,
            vocab_size=loaded.vocab_size,
            eos_token_ids=list(loaded.eos_token_ids),
        )
        self.grammars = GrammarCompiler(self.info.tokenizer_dir, loaded.vocab_size, loaded.eos_token_ids)
        self.sampler.grammars = self.grammars

    def _load_drafter(self, spec: SpeculativeConfig, target: LoadedModel, dtype: mx.Dtype) -> DraftProposer:
        draft = load_model(spec.model, self.config.dtype)
        if draft.vocab_size != target.vocab_size:
            raise ModelLoadError(
                f"draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens; "
                f"the target's has {target.vocab_size}: they must share a tokenizer"
            )
        runner = ModelRunner(draft.model, self.config.block_size, draft.num_kv_heads, draft.head_dim, dtype)
        return DraftProposer(runner, self.sampler)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        cache_salt: str | None = None, app: str | None = None, priority: int = 0,
    ) -> None:
        """Queue a request; raises at once if it is malformed or can never fit.

        Requests share cached prefix blocks only when their app and
        ``cache_salt`` are both equal. ``app`` names the sender for fair share;
        a lower ``priority`` is admitted first (vLLM's convention).
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        params.validate(self.info.vocab_size)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {n} tokens", param="messages",
            )
        if min(max(prompt_token_ids), min(prompt_token_ids)) < 0 or max(prompt_token_ids) >= self.info.vocab_size:
            raise InvalidRequestError("prompt token ids out of range", param="prompt")
        longest = min(n + params.max_tokens, self.max_model_len)
        if self.kv.blocks_for(longest) > self.kv.pool.num_blocks:
            raise ContextLengthError(
                f"the request needs up to {longest} tokens of KV cache but the pool holds "
                f"{self.kv.pool.num_blocks * self.config.block_size}", param="max_tokens",
            )
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise OverloadedError(
                f"{len(self.scheduler.waiting)} requests are already waiting "
                f"(--max-waiting-requests {self.config.max_waiting_requests}); retry later"
            )
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        # The app enters the salt: one app can never hit, or time, another's cache.
        salt = f"{app or ''}\x00{cache_salt or ''}".encode() if app or cache_salt else b""
        req = Request(request_id, prompt_token_ids, params, seed, salt, app or "", priority)
        if params.structured is not None:
            req.grammar = self.grammars.submit(params.structured)
            self._compiling.append(req)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_ids) -> None:
        """Stop requests now and free their blocks; unknown or finished ids are ignored."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self.scheduler.finish(req, "abort")
            self.metrics.on_finish(req, time.monotonic())
            self._aborted.append(self._output(req))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._failed)

    def take_errors(self) -> list[tuple[str, InvalidRequestError]]:
        """Requests failed since the last call (their grammar did not compile), as (id, error).

        They produce no RequestOutput; the caller reports the error instead.
        """
        failed, self._failed = self._failed, []
        return failed

    def _check_grammars(self) -> None:
        """Fail requests whose grammar did not compile; forget those that are ready or gone."""
        still = []
        for req in self._compiling:
            if req.finished:
                continue
            if not req.grammar.ready:
                still.append(req)
            elif req.grammar.error is not None:
                self.scheduler.finish(req, "error")
                del self.requests[req.request_id]
                self._failed.append((req.request_id, req.grammar.error))
        self._compiling = still

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.queries,
            prefix_cache_hits=self.kv.hits,
        )

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        outputs, self._aborted = self._aborted, []
        if self._compiling:
            self._check_grammars()
        if self.speculator:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self._compiling:
                # Nothing else to run: wait briefly for a grammar instead of spinning.
                wait_futures([r.grammar.future for r in self._compiling], timeout=0.005,
                             return_when=FIRST_COMPLETED)
            self.metrics.on_step(0, 0.0, self.stats())
            return outputs
        # Rows needing logits per request: none for a prefill chunk short of the
        # end, the last row otherwise, plus one per draft token.
        num_logits = [
            len(r.spec_tokens) + 1 if r.num_computed_tokens + n >= r.num_tokens else 0
            for r, n in sched.scheduled
        ]
        tables = [self.kv.block_ids(r.request_id) for r, _ in sched.scheduled]
        if self.speculator:
            self.speculator.draft(sched.scheduled, tables)
        logits = self.runner.execute(sched.scheduled, tables, num_logits)
        emitted = self._sample(sched, num_logits, logits)
        outputs += self._update(sched, emitted)
        self.metrics.on_step(sched.num_tokens, time.monotonic() - start, self.stats())
        return outputs

    def _sample(self, sched: SchedulerOutput, num_logits: list[int], logits: mx.array) -> dict:
        """Sample plain rows and verify draft windows in one evaluation.

        Returns {request: (new tokens, their Logprob records or Nones)}.
        """
        plain, spec, row = [], [], 0
        for (req, _), k in zip(sched.scheduled, num_logits):
            if k:
                (spec if req.spec_tokens else plain).append((req, row))
            row += k
        pending = [self.runner.caches()]
        if plain:
            preqs = [r for r, _ in plain]
            tokens, plp = self.sampler(logits[mx.array([o for _, o in plain])], preqs)
            pending += [tokens, plp or []]
        if spec:
            arrays, spec_results = self.speculator.verify(logits, spec)
            pending += arrays
        mx.eval(pending)
        emitted = {}
        if plain:
            toks = tokens.tolist()
            lps = logprobs_for(plp, toks, preqs) if plp else [None] * len(preqs)
            emitted = {req: ([tok], [lp]) for req, tok, lp in zip(preqs, toks, lps)}
        if spec:
            emitted.update(spec_results())
        return emitted

    def _update(self, sched: SchedulerOutput, emitted: dict) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for req, n in sched.scheduled:
            new = emitted.get(req)
            if new is None:  # a prefill chunk short of the end
                req.num_computed_tokens += n
                self.kv.commit(req)
                continue
            tokens, lps = new
            # Known tokens plus the accepted drafts now have their K/V in the cache.
            req.num_computed_tokens += n - len(req.spec_tokens) + len(tokens) - 1
            req.draft_computed = min(req.draft_computed, req.num_computed_tokens)
            req.spec_tokens = []
            self.metrics.on_token(req, now, len(tokens))
            reason = None
            for token, lp in zip(tokens, lps):
                req.token_ids.append(token)
                req.pending_tokens.append(token)
                if lp is not None:
                    req.pending_logprobs.append(lp)
                reason = self._stop_reason(req, token)
                if req.grammar is not None and not reason:
                    reason = req.grammar.accept(token)
                if reason:
                    break
            if reason:
                self.scheduler.finish(req, reason)
                self.metrics.on_finish(req, now)
                del self.requests[req.request_id]
            else:
                self.kv.commit(req)
            outputs.append(self._output(req))
        return outputs

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        # The sampler masks stop tokens until min_tokens are out, so a stop token here is final.
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.sampler.eos_token_ids):
            req.stop_token_id = token
            return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, req: Request) -> RequestOutput:
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.pending_tokens,
            finish_reason=req.finish_reason,
            logprobs=req.pending_logprobs or None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            stop_token_id=req.stop_token_id,
        )
        req.pending_tokens, req.pending_logprobs = [], []
        return out

    # -- convenience --------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; returns each one's generated token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{os.getpid()}-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        pending = set(ids)
        while pending:
            for rid, err in self.take_errors():
                if rid in results:
                    raise err
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
                    if out.finish_reason:
                        pending.discard(out.request_id)
        return [results[rid] for rid in ids]

