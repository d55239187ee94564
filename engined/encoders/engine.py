"""The engine for encoder models (BERT, MiniLM, XLM-R, ModernBERT): embed requests, one batch per step.

An encoder has no KV cache and no decode: each step takes the waiting
requests that fit the step (``max_num_seqs`` of them, ``max_num_batched_tokens``
counted as the padded batch ``rows x longest``, at least one; apps take turns), embeds them in
one ``EncoderModel.embed`` call and finishes them. It speaks the same
interface as ``engined.engine.Engine`` (add_request / step / abort /
take_errors / stats / info / metrics), so the daemon and the wire do not
know which one they run. The memory guard counts its weights and the peak of
its largest batch against the budget.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from pathlib import Path

import numpy as np

from mlxd.engined import memory_guard
from mlxd.engined.device import device_kind
from mlxd.engined.encoders.pooling import matryoshka_dimensions
from mlxd.engined.metrics import EngineMetrics
from mlxd.engined.request import Request, Status, WaitingPlaces, take_output
from mlxd.shared.config import EngineConfig
from mlxd.shared.errors import ContextLengthError, InvalidRequestError, ModelLoadError
from mlxd.shared.protocol import TASKS, EngineStats, ModelInfo, RequestOutput, SamplingParams

log = logging.getLogger("mlxd.engine")


def encoder_dir(model: str) -> Path | None:
    """The model's folder when it holds an encoder model (``EncoderModel.is_encoder_dir``), else None."""
    path = Path(model) if model else None
    if path is None or not path.is_dir():
        return None
    from mlxd.engined.encoders.text import EncoderModel

    return path if EncoderModel.is_encoder_dir(path) else None


class EncoderEngine:
    def __init__(self, config: EngineConfig, path: Path, progress: bool = False):
        from mlxd.engined.encoders.text import EncoderModel

        if config.task not in ("auto", "embed"):
            raise ModelLoadError(f"{path} is an encoder model: it serves --task embed, not {config.task}")
        config = config.for_device(device_kind())
        self.config = config
        self.model = EncoderModel.load(path)
        limit = self.model.max_length
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ModelLoadError(f"--max-model-len {config.max_model_len} is past this encoder's "
                                 f"{limit} positions")
        self.max_model_len = config.max_model_len or limit
        self.memory = memory_guard.plan_encoder(self.model.embed, self.model.nbytes, config, self.max_model_len)
        log.info("%s", self.memory.describe())
        name = config.served_model_name or path.name
        self.info = ModelInfo(
            model_id=path.name, served_model_name=name, tokenizer_dir=str(path),
            max_model_len=self.max_model_len, block_size=config.block_size, num_kv_blocks=0,
            vocab_size=_vocab_size(path), eos_token_ids=[], tasks=["embed"], embedding_dim=self.model.dim,
            matryoshka_dimensions=matryoshka_dimensions(path),
        )
        self.places = WaitingPlaces(config.max_waiting_requests)
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._ended: list[RequestOutput] = []
        self._failed: list[tuple[str, InvalidRequestError]] = []
        self.metrics = EngineMetrics(name, config, self.max_model_len, self.stats)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, app: str | None = None, priority: int = 0,
                    group: str | None = None, group_size: int = 1, params_n: int = 1,
                    task: str = "generate", lora_name: str | None = None, images: list | None = None) -> None:
        """Queue an embed request (``Engine.add_request``'s contract; ``params`` and ``cache_salt`` are unused)."""
        if images:
            raise InvalidRequestError("this model takes no images", param="input")
        self.places.take(group, group_size, len(self.waiting))
        if lora_name is not None:
            raise InvalidRequestError(f"this model serves no LoRA adapters (asked for {lora_name!r})",
                                      param="lora_name")
        if task != "embed":
            raise InvalidRequestError(f"this model serves embed requests, not {task}" if task in TASKS
                                      else f"unknown task {task!r}")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if not n:
            raise InvalidRequestError("the prompt is empty")
        if n > self.max_model_len:
            raise ContextLengthError(f"this model's maximum context length is {self.max_model_len} tokens; "
                                     f"the prompt has {n} tokens")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.info.vocab_size:
            raise InvalidRequestError("prompt token ids out of range")
        req = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=1), 0, b"", app or "", priority,
                      params_n, "embed")
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "abort"
            self.metrics.on_finish(req, time.monotonic())
            self._ended.append(take_output(req))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self._ended or self._failed)

    def take_errors(self) -> list[tuple[str, InvalidRequestError]]:
        failed, self._failed = self._failed, []
        return failed

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=len(self.waiting))

    def release_idle_memory(self) -> bool:
        return False  # no pool to cut back: weights and the capped buffer cache are all it holds

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        outputs, self._ended = self._ended, []
        batch = self._take_batch()
        if not batch:
            self.metrics.on_step(0, 0.0, self.stats())
            return outputs
        for req in batch:
            req.status, req.first_scheduled_time = Status.RUNNING, start
        try:
            vectors = np.asarray(self.model.embed([r.token_ids for r in batch]), dtype="<f4")
        except Exception as e:  # the batch's forward broke: its requests fail, the engine goes on
            log.warning("failing %d request(s): the encoder raised %s: %s", len(batch), type(e).__name__, e)
            for req in batch:
                req.status = Status.FINISHED
                del self.requests[req.request_id]
                self._failed.append((req.request_id, InvalidRequestError(
                    f"the request failed: the encoder raised {type(e).__name__}: {e}")))
            return outputs
        now = time.monotonic()
        for req, vector in zip(batch, vectors):
            req.embedding = vector.tobytes()
            req.status, req.finish_reason = Status.FINISHED, "stop"
            req.num_computed_tokens = req.num_tokens
            del self.requests[req.request_id]
            self.metrics.on_pooled(req, now)
            self.metrics.on_finish(req, now)
            outputs.append(take_output(req))
        self.metrics.on_step(sum(r.num_tokens for r in batch), now - start, self.stats())
        return outputs

    def _take_batch(self) -> list[Request]:
        """The waiting requests of this step within the padded budget: best priority first, then the
        apps in turn (each app's oldest, then each one's next, ...), so that one app's large batch
        (an indexing job) cannot hold another's single query back for its whole length."""
        turns: dict[str, int] = {}
        keyed = []
        for req in sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time)):
            turn = turns[req.app] = turns.get(req.app, -1) + 1
            keyed.append(((req.priority, turn, req.arrival_time), req))
        order = [req for _, req in sorted(keyed, key=lambda k: k[0])]
        batch, longest = [], 0
        for req in order[: self.config.max_num_seqs]:
            wider = max(longest, req.num_tokens)
            if batch and wider * (len(batch) + 1) > self.config.max_num_batched_tokens:
                break
            batch.append(req)
            longest = wider
        for req in batch:
            self.waiting.remove(req)
        return batch


def _vocab_size(path: Path) -> int:
    try:
        return int(json.loads((path / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}/config.json gives no vocab_size: {e}") from None
