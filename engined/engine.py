"""The in-process engine: requests in, token ids out, one packed step at a time.

    schedule -> run the packed forward -> sample (launched) -> postprocess (in the scheduler)

With asynchronous scheduling (``EngineConfig.async_scheduling``) a step's
sampled tokens stay on the device while the next step is scheduled and built
(``sampler.LaunchedStep``); they are read after it is launched, or before it is
scheduled where a request needs them on the host (``_must_read_first``). With an
encode thread (``EngineConfig.encode_thread``), MLX encodes each launched step's
graph there while this thread postprocesses the step before and builds the next.

The daemon wraps this object; tests and benchmarks use it directly.

Over 400 lines because it is the one object that builds the collaborators and drives them, in three
screens (construction, request intake, the step): validation, output records and drafter loading already
live with what they concern (``request.check_prompt``/``take_output``, ``speculation.proposers``), and split
further, two halves of one state machine would pass the same dozen fields back and forth.
"""

from __future__ import annotations

import logging
import os
import random
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext

import mlx.core as mx

from mlxd.engined import kernels
from mlxd.engined import memory_guard
from mlxd.engined.device import device_kind
from mlxd.engined.encoders.pooling import matryoshka_dimensions, pooled_results, score_token_ids, store_results
from mlxd.engined.fastpath.encode_thread import EncodeThread
from mlxd.engined.kernels.gpu import SDPA_BUCKET
from mlxd.engined.kv.disk_tier import weights_fingerprint
from mlxd.engined.kv.kinds import build_manager
from mlxd.engined.kv.manager import KVCacheManager
from mlxd.engined.loaders import LoadedModel, load_model
from mlxd.engined.lora.registry import LoraRegistry
from mlxd.engined.metrics import EngineMetrics
from mlxd.engined.model_layers import LayerSpec, float_dtype, read_layers
from mlxd.engined.parallel import model_split, pipeline
from mlxd.engined.request import Request, WaitingPlaces, check_prompt, take_output
from mlxd.engined.runner import LastTokenNorm, ModelRunner
from mlxd.engined.sampler import LaunchedStep, Sampler, needs_host_tokens
from mlxd.engined.scheduler import Scheduler, SchedulerOutput
from mlxd.engined.speculation import proposers
from mlxd.engined.speculation.speculator import Speculator
from mlxd.engined.structured import GrammarCompiler
from mlxd.engined.vision.embeds import check_images, image_embeds
from mlxd.shared.config import EngineConfig, SpeculativeConfig
from mlxd.shared.errors import ContextLengthError, InvalidRequestError, NotFoundError
from mlxd.shared.protocol import (TASKS, EngineStats, ImageInput, LoraAdapter, ModelInfo, RequestOutput,
                                  SamplingParams)

log = logging.getLogger("mlxd.engine")


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, progress: bool = False):
        config = config.for_device(device_kind())
        self.config = config
        # Start-up's phases, logged once ready: a long start says which one to look at.
        start = time.perf_counter()
        loaded = loaded or load_model(config.model, config.dtype)
        loaded_at = time.perf_counter()
        self.loaded = loaded
        self.max_model_len = config.max_model_len or loaded.context_length
        # An encoder folder runs in engined.encoders.engine instead; auto here is a decoder's generate.
        self.task = "generate" if config.task == "auto" else config.task
        dtype = float_dtype(loaded.model)
        backend = kernels.resolve_backend(config.attention_backend)
        pipelined = config.num_ranks > 1
        spec = proposers.resolve(config.speculative)  # a Gemma 4 assistant given as a draft model is MTP

        # How steps run. Speculation proposes from the last tokens on the host, and a pipeline sends
        # the other ranks host token ids: both read every step before the next.
        self.async_scheduling = config.async_scheduling and spec is None and not pipelined
        # Steps built on this thread and encoded on another (engined/fastpath/encode_thread.py); not where
        # attention reads its inputs on the host ("host"), which evaluates while the step is being built.
        self.encoder = (EncodeThread() if self.async_scheduling and config.encode_thread and backend != "host"
                        else None)

        # The model and its KV cache. Adapter slots are made before the memory guard measures the
        # weights, so it counts them.
        specs, kv = _layers_and_kv(loaded.model, config, spec, dtype, self.encoder)
        self.lora = (LoraRegistry(loaded.model, config.max_loras, config.max_lora_rank, dtype, config.max_cpu_loras,
                                  term_kernel=backend == "cuda") if config.enable_lora else None)
        self.runner = _runner(loaded.model, specs, kv, backend, config, spec, self.lora, loaded.vision)
        kv = self.runner.kv  # on several ranks, the journal the other ranks replay

        # Sampling, and the drafter that proposes for it when speculation is on.
        self.grammars = GrammarCompiler(str(loaded.tokenizer_dir), loaded.vocab_size, loaded.eos_token_ids)
        self.sampler = Sampler(loaded.vocab_size, loaded.eos_token_ids, self.grammars,
                               choose_on_device=self.async_scheduling)
        self.drafter = (proposers.load_drafter(spec, loaded, config, dtype, self.sampler, backend)
                        if spec and spec.method == "draft_model" else None)
        # The checkpoint's MTP layer; its K/V are a group of the KV manager (billed with it).
        self.mtp = (proposers.load_mtp(spec, loaded, self.runner.head, kv, config, dtype, self.sampler, backend)
                    if spec and spec.method == "mtp" else None)

        # The memory guard sizes the KV pool from what is left beside everything built so far.
        built_at = time.perf_counter()
        stores = ([kv] + ([self.drafter] if self.drafter else []) + ([self.lora] if self.lora else [])
                  + ([self.runner.images] if self.runner.images else []))
        self.memory = memory_guard.plan(self.runner, stores, config, self.max_model_len, loaded.vocab_size,
                                        progress, kernels=backend in ("metal", "cuda") and not pipelined)
        if pipelined:
            self.memory = self.runner.agree(self.memory)
        log.info("%s", self.memory.describe())
        log.info("start-up: model loaded in %.1f s, steps built in %.1f s, warm-up (memory guard, kernels) %.1f s",
                 loaded_at - start, built_at - loaded_at, time.perf_counter() - built_at)
        if self.drafter:
            kv.follow(self.drafter.kv)
        kv.create(self.memory.num_blocks, self.memory.resident_blocks)

        # Scheduling, its metrics, and speculation's part in the step (None when it is off: a plain
        # step never enters engined.speculation). A pipeline keeps a batch per lane in flight
        # (engined/parallel/pipeline.py); speculation proposes from every running request's host
        # tokens, so it keeps one.
        self.num_lanes = ((config.pipeline_batches or config.pipeline_parallel_size)
                          if config.pipeline_parallel_size > 1 and spec is None else 1)
        self.scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   tuple(loaded.eos_token_ids), self.lora, self.num_lanes,
                                   chunk_align=SDPA_BUCKET if backend == "cuda" else 1)
        self.metrics = EngineMetrics(config.served_model_name or loaded.model_id, config, self.max_model_len,
                                     self.scheduler.stats, kv.disk.store.totals if kv.disk is not None else None)
        self.speculator = (Speculator(spec, self.sampler, self.metrics, self.max_model_len, self.drafter or self.mtp,
                                      kv.block_ids) if spec is not None else None)

        self._inflight: LaunchedStep | None = None  # the step launched whose tokens are not read yet
        # Steps launched, and seconds the host spent blocked reading their tokens (the rest of a
        # step's time is the host's own work: benchmarks report both).
        self.num_steps = 0
        self.sync_wait_s = 0.0
        self.requests: dict[str, Request] = {}
        self._seeds = random.Random(config.seed)
        self.places = WaitingPlaces(config.max_waiting_requests)
        self._aborted: list[RequestOutput] = []
        # Requests whose grammar is compiling, and those that failed after being accepted (id, error).
        self._compiling: list[Request] = []
        self._failed: list[tuple[str, InvalidRequestError]] = []

        self.info = _model_info(loaded, config, self.task, self.max_model_len, self.memory.num_blocks,
                                self.runner.head)
        self.score_ids = (score_token_ids(loaded.tokenizer_dir, config.score_tokens)
                          if self.task == "score" else None)
        for name, path in config.lora_adapters:
            self.load_lora(name, path)
        if self.lora is not None:
            log.info("LoRA: %d slot(s) of rank %d, %.1f MiB; adapters: %s", config.max_loras, config.max_lora_rank,
                     self.lora.nbytes / 2**20, ", ".join(self.lora.adapters) or "none yet")

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        cache_salt: str | None = None, app: str | None = None, priority: int = 0,
        group: str | None = None, group_size: int = 1, params_n: int = 1, task: str = "generate",
        lora_name: str | None = None, images: list[ImageInput] | None = None,
    ) -> None:
        """Queue a request; raises at once if it is malformed or can never fit.

        Requests share cached prefix blocks only when their app and
        ``cache_salt`` are both equal. ``app`` names the sender for fair share;
        a lower ``priority`` is admitted first (vLLM's convention). Errors name
        no request field: the gateway knows which of its fields they concern.
        ``group``: see ``WaitingPlaces``. ``params_n``: the client request's n, recorded
        once per prompt (0 on its other choices). ``task`` (``shared.protocol.TASKS``)
        must be the model's; embed and score requests are prefill only (their
        sampling parameters are ignored) and finish with their result. ``lora_name`` picks a
        loaded adapter (NotFoundError for another name). ``images`` fill their placeholder tokens
        (a vision-language model only).
        """
        adapter = self._adapter(lora_name)
        self.places.take(group, group_size, len(self.scheduler.waiting))
        if task not in self.info.tasks:
            raise InvalidRequestError(f"this model serves {', '.join(self.info.tasks)} requests, not {task}"
                                      if task in TASKS else f"unknown task {task!r}")
        pooled = task != "generate"
        if pooled:
            params = SamplingParams(max_tokens=1)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_prompt(prompt_token_ids, params, self.max_model_len, self.info.vocab_size, pooled)
        if images:
            check_images(images, len(prompt_token_ids), self.runner.images,
                         self.info.served_model_name)
        longest = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        if not self.scheduler.can_ever_fit(longest):
            raise ContextLengthError(
                f"the request needs up to {longest} tokens of KV cache but the pool holds "
                f"{self.info.num_kv_blocks * self.config.block_size}"
            )
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        # The app enters the salt: one app can never hit, or time, another's cache.
        salt = f"{app or ''}\x00{cache_salt or ''}".encode() if app or cache_salt else b""
        if adapter is not None:  # an adapter's K/V differ from the base's for the same tokens
            salt += f"\x00lora\x00{adapter.uid}".encode()
        req = Request(request_id, prompt_token_ids, params, seed, salt, app or "", priority, params_n, task, lora_name,
                      images or None)
        if params.structured is not None:
            req.grammar = self.grammars.submit(params.structured, request_id)
            self._compiling.append(req)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _adapter(self, name: str | None):
        if name is None:
            return None
        adapter = self.lora.adapters.get(name) if self.lora is not None else None
        if adapter is None:
            raise NotFoundError(f"The model `{name}` does not exist; this server serves "
                                f"`{self.info.served_model_name}`"
                                + (f" and the LoRA adapters {', '.join(self.lora.adapters)}"
                                   if self.lora and self.lora.adapters else ""), param="model")
        return adapter

    # -- LoRA adapters ----------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as model ``name``; raises (400/404) with the reason."""
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters are off: start the engine with --enable-lora",
                                      param="lora_name")
        if name in (self.info.served_model_name, self.info.model_id):
            raise InvalidRequestError(f"{name!r} is the base model's name; give the adapter another",
                                      param="lora_name")
        adapter = self.lora.register(name, path)
        self.info.lora_adapters.append(LoraAdapter(name=name, path=adapter.path))
        log.info("LoRA adapter %s loaded from %s (rank %d, %d modules)", name, path, adapter.rank,
                 adapter.num_modules)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; refused while requests still use it."""
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters are off: start the engine with --enable-lora",
                                      param="lora_name")
        self.lora.unregister(name, sum(r.lora_name == name for r in self.requests.values()))
        self.info.lora_adapters = [a for a in self.info.lora_adapters if a.name != name]
        log.info("LoRA adapter %s unloaded", name)

    def abort(self, request_ids) -> None:
        """Stop requests now and free their blocks; unknown or finished ids are ignored."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self.scheduler.finish(req, "abort")
            self.metrics.on_finish(req, time.monotonic())
            self._aborted.append(take_output(req))

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._failed)
                or self._inflight is not None or (self.num_lanes > 1 and bool(self.runner.sent)))

    def take_errors(self) -> list[tuple[str, InvalidRequestError]]:
        """Requests failed since the last call, as (id, error): their grammar did not compile, or
        their sampling setup, draft proposal or grammar step raised. They produce no RequestOutput; the caller reports the error instead.
        """
        failed, self._failed = self._failed, []
        return failed

    def _fail(self, req: Request, error: InvalidRequestError) -> None:
        self.scheduler.finish(req, "error")
        del self.requests[req.request_id]
        self._failed.append((req.request_id, error))

    def _fail_raised(self, raised: list[tuple[Request, Exception]], what: str) -> None:
        """Fail requests whose own step work raised; the step goes on for the others."""
        for req, e in raised:
            log.warning("failing request %s: %s: %s: %s", req.request_id, what, type(e).__name__, e)
            self._fail(req, InvalidRequestError(f"the request failed: {what}: {type(e).__name__}: {e}"))

    def _check_grammars(self) -> None:
        """Fail requests whose grammar did not compile; forget those that are ready or gone."""
        still = []
        for req in self._compiling:
            if req.finished:
                continue
            if not req.grammar.ready:
                still.append(req)
            elif req.grammar.error is not None:
                self._fail(req, req.grammar.error)
        self._compiling = still

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns the outputs of the step whose tokens were read.

        Synchronous: the step launched here is read before returning.
        Asynchronous: it stays in flight and the step launched before it is
        read instead, once this one is queued behind it on the device.
        """
        start = time.monotonic()
        outputs = self._take_ended()
        if self.num_lanes > 1:
            return outputs + self._step_lanes(start)
        if self._inflight is not None and self._must_read_first():
            outputs += self._read_inflight()
        speculator = self.speculator
        drafts = speculator.propose(self.scheduler.running) if speculator else None
        if speculator:
            self._fail_raised(speculator.take_failures(), "its draft could not be proposed")
        batch = self.scheduler.schedule(drafts)
        for req, error in self.scheduler.take_lora_failures():
            self._fail(req, error)
        if speculator:
            speculator.draft(batch)
        if not batch.scheduled:
            return outputs + (self._read_inflight() if self._inflight is not None else self._idle())
        launched = self._launch(batch)
        self.num_steps += 1
        # On the device's queue (or the encode thread's) before the step in flight is waited for, so the
        # device goes from one step to the next without waiting for the host.
        launched.start(self.encoder)
        if self._inflight is not None:
            outputs += self._read_inflight()
        self._inflight = launched
        if not self.async_scheduling:
            outputs += self._read_inflight()
        self.metrics.on_step(batch.num_tokens, time.monotonic() - start, self.stats())
        if self.lora is not None:
            waiting = sorted({r.lora_name for r in self.scheduler.waiting if r.lora_name})
            self.metrics.on_lora(self.config.max_loras, self.lora.running(), waiting)
        return outputs

    def _step_lanes(self, start: float) -> list[RequestOutput]:
        """A pipeline's step: a batch sent down for each lane with none out, then the oldest one's
        last stage run here and read, while the other ranks compute the later ones."""
        out = {s.lane for s in self.runner.sent}
        for lane in range(self.num_lanes):
            if lane not in out and (batch := self.scheduler.schedule(lane=lane)).scheduled:
                self.runner.send(batch, lane)
        if not self.runner.sent:
            return self._idle()
        batch = self.runner.sent[0].batch
        self._inflight = self._launch(batch)
        self._inflight.start()
        self.num_steps += 1
        outputs = self._read_inflight()
        self.metrics.on_step(batch.num_tokens, time.monotonic() - start, self.stats())
        return outputs

    def _launch(self, batch: SchedulerOutput) -> LaunchedStep:
        """Build the step's forward and sampling, for the caller to ``start``; the scheduler then
        counts its tokens as computed and its samples as placeholders."""
        with mx.stream(self.encoder.stream) if self.encoder is not None else nullcontext():
            # Only a ModelRunner takes placeholders: a pipeline's step never finds one in flight.
            logits, hidden = (self.runner.run_pooled(batch) if self._inflight is None
                              else self.runner.run_pooled(batch, inflight=self._inflight))
            pooled = (pooled_results(batch, logits, hidden, self.score_ids)
                      if any(r.pooled for r, _ in batch.scheduled) else None)
            launched = self._sample(batch, logits, pooled)
        self.scheduler.advance(batch)
        return launched

    def _must_read_first(self) -> bool:
        """Sync point before scheduling: a request of the step in flight needs its token on the host
        to be stepped again (its grammar's mask, its penalties)."""
        return any(needs_host_tokens(r) and not r.finished for r, _ in self._inflight.batch.scheduled)

    def _read_inflight(self) -> list[RequestOutput]:
        """Sync point: wait for the step in flight, read its tokens and postprocess them."""
        launched, self._inflight = self._inflight, None
        t0 = time.perf_counter()
        emitted = launched.read()
        if launched.pooled:
            store_results(launched.pooled)
        self.sync_wait_s += time.perf_counter() - t0
        produced = self.scheduler.postprocess(launched.batch, emitted)
        self._fail_raised(launched.batch.failed, "its grammar could not take the sampled token")
        return self._outputs(produced)

    def release_idle_memory(self) -> bool:
        """Cut the KV pool back after a while with no request holding a block (the daemon's idle loop
        calls this); True if it did."""
        kv = self.runner.kv
        if not kv.release_idle(time.monotonic()):
            return False
        log.info("idle: KV pool cut back to %d resident blocks of %d", kv.pool.num_resident, kv.pool.num_blocks)
        return True

    def _idle(self) -> list[RequestOutput]:
        # Nothing else to run: wait briefly for a grammar, or blocks read from disk, instead of spinning.
        waits = [r.grammar.future for r in self._compiling] + self.scheduler.kv.reads()
        if waits:
            wait_futures(waits, timeout=0.005, return_when=FIRST_COMPLETED)
        self.metrics.on_step(0, 0.0, self.stats())
        return []

    def _take_ended(self) -> list[RequestOutput]:
        """Outputs of requests aborted since the last step; requests whose grammar failed are failed now."""
        outputs, self._aborted = self._aborted, []
        if self._compiling:
            self._check_grammars()
        return outputs

    def _sample(self, batch: SchedulerOutput, logits: mx.array, pooled: list | None) -> LaunchedStep:
        """Sample plain rows and verify draft windows in one evaluation, launched (not read).

        A request whose own sampling setup raises (a parameter MLX cannot take,
        a grammar that breaks) fails alone: it leaves the batch, its client gets
        the error through ``take_errors``, and the others are sampled again.
        """
        rows, row = [], 0
        for (req, _), k in zip(batch.scheduled, batch.num_logits):
            if k and not req.pooled:
                rows.append((req, row))
            row += k
        try:
            return LaunchedStep.sample(batch, rows, logits, self.sampler, self.speculator, self.runner.kv.arrays(),
                                       pooled)
        except Exception as e:
            if self.encoder is not None:
                self.encoder.wait()  # the trials below evaluate on the stream it encodes
            culprits = {req for req, _ in rows if not self._can_sample(req)}
            if not culprits:
                raise  # not one request's doing: the engine itself is broken
            log.warning("failing %d request(s) whose sampling setup raised: %s: %s",
                        len(culprits), type(e).__name__, e)
            for req in culprits:
                self._fail(req, InvalidRequestError(f"the request could not be sampled: {type(e).__name__}: {e}"))
            batch.scheduled = [(r, n) for r, n in batch.scheduled if r not in culprits]
            return LaunchedStep.sample(batch, [(r, o) for r, o in rows if r not in culprits], logits, self.sampler,
                                       self.speculator, self.runner.kv.arrays(), pooled)

    def _can_sample(self, req: Request) -> bool:
        """Whether one row of this request alone samples without raising (finds a step's culprits)."""
        try:
            tokens, lp = self.sampler(mx.zeros((1, self.info.vocab_size)), [req])
            mx.eval(tokens, lp or [])
            return True
        except Exception:
            return False

    def _outputs(self, produced: list[tuple[Request, int]]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        self.metrics.on_tokens([(req, count) for req, count in produced if not req.pooled], now)
        for req, count in produced:
            if req.pooled:
                self.metrics.on_pooled(req, now)
            if req.finished:
                self.metrics.on_finish(req, now)
                del self.requests[req.request_id]
            outputs.append(take_output(req))
        return outputs

    # -- convenience --------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 loras: list[str | None] | None = None) -> list[list[int]]:
        """Run prompts to completion together (``loras[i]``: prompt i's adapter); returns each one's token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{os.getpid()}-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p, lora in zip(ids, prompts, plist, loras or [None] * len(prompts)):
            self.add_request(rid, prompt, p, lora_name=lora)
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


def _layers_and_kv(model, config: EngineConfig, spec: SpeculativeConfig | None, dtype: mx.Dtype,
                   encoder: EncodeThread | None) -> tuple[list[LayerSpec], KVCacheManager]:
    """The layers this process runs (all of them, or its part of a pipeline or tensor-parallel group)
    and the KV cache manager of their groups, whose pool waits for ``encoder`` before it resizes."""
    if config.num_ranks > 1:
        model_split.prepare(model, pipeline.join(config), config)
    specs = read_layers(model)
    # The disk tier keeps the main pool's K/V alone: not a draft model's, nor another rank's.
    weights = weights_fingerprint(model) if config.kv_disk_cache and spec is None and config.num_ranks == 1 else None
    kv = build_manager(specs, config, dtype, settle=encoder.wait if encoder is not None else None, weights=weights)
    if spec is not None and not kv.can_rewind:
        raise InvalidRequestError(
            "speculative decoding is not supported for this model: one of its caches cannot take "
            "rejected draft tokens back", param="speculative_config",
        )
    return specs, kv


def _runner(model, specs: list[LayerSpec], kv: KVCacheManager, backend: str, config: EngineConfig,
            spec: SpeculativeConfig | None, lora: LoraRegistry | None, vision=None
            ) -> ModelRunner | pipeline.MirroredRunner:
    """Rank 0's runner of a group of ranks, or this process's own."""
    if config.num_ranks > 1:
        return pipeline.MirroredRunner(model, specs, kv, backend, config)
    # Not where a drafter reads the target's hidden states as its forward runs (MTP, a Gemma 4
    # assistant): a replayed step runs none of the model's Python, so would hand it none.
    compile_decode = bool(config.compile_decode) and (spec is None or spec.method != "mtp")
    return ModelRunner(model, specs, kv, backend, lora, compile_decode, image_embeds(vision, config))


def _model_info(loaded: LoadedModel, config: EngineConfig, task: str, max_model_len: int, num_kv_blocks: int,
                head: LastTokenNorm) -> ModelInfo:
    """What the gateways are told about the model served (``READY``)."""
    return ModelInfo(
        model_id=loaded.model_id,
        served_model_name=config.served_model_name or loaded.model_id,
        tokenizer_dir=str(loaded.tokenizer_dir),
        max_model_len=max_model_len,
        block_size=config.block_size,
        num_kv_blocks=num_kv_blocks,
        vocab_size=loaded.vocab_size,
        eos_token_ids=list(loaded.eos_token_ids),
        tasks=[task],
        enable_lora=config.enable_lora,
        # The final norm's width: what an embed row's hidden state has.
        embedding_dim=int(head.inner.weight.shape[-1]) if task == "embed" else 0,
        matryoshka_dimensions=matryoshka_dimensions(loaded.tokenizer_dir) if task == "embed" else None,
        max_image_pixels=loaded.vision.max_pixels if loaded.vision is not None else None,
    )
