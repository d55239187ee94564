"""One request's state inside the engine, and the places in the waiting queue (``--max-waiting-requests``)
that whole client requests take."""

from __future__ import annotations

import enum
import time

from mlxd.shared.errors import ContextLengthError, InvalidRequestError, OverloadedError
from mlxd.shared.protocol import Logprob, RequestOutput, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Tokens, progress and sampling state of one sequence.

    ``token_ids`` is prompt + generated; ``num_computed_tokens`` of them have
    their K/V in the cache. After preemption ``num_computed_tokens`` drops to
    the prefix still cached and the rest is recomputed.
    """

    __slots__ = (
        "request_id", "params", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "num_cached_tokens", "status", "finish_reason", "stop_token_id", "seed",
        "arrival_time", "pending_tokens", "pending_logprobs", "block_hashes", "cache_salt",
        "first_scheduled_time", "first_token_time", "last_token_time", "app", "priority", "grammar",
        "params_n", "task", "embedding", "score", "lora_name", "lora_slot", "num_placeholders",
        "lane", "images",
    )

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
        cache_salt: bytes = b"", app: str = "", priority: int = 0, params_n: int = 1,
        task: str = "generate",
        lora_name: str | None = None, images: list | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None
        self.seed = seed
        # Monotonic timestamps for the latency metrics.
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # Generated since the last output was sent.
        self.pending_tokens: list[int] = []
        self.pending_logprobs: list[Logprob] = []
        # Chained hashes of this request's full blocks, grown as blocks fill.
        self.block_hashes: list[bytes] = []
        # Isolates prefix-cache sharing: only requests with the same salt share blocks.
        self.cache_salt = cache_salt
        # Who sent it (fair share between apps) and vLLM's priority (lower runs first).
        self.app = app
        self.priority = priority
        # The client request's n for vLLM's request_params_n; 0 on all but one choice of a prompt.
        self.params_n = params_n
        # The structured-output matcher (engined.structured.Grammar); None when unconstrained.
        self.grammar = None
        # Tokens sampled by a step still running on the device (asynchronous scheduling): they
        # follow ``token_ids`` but the host has not read them yet. At most one.
        self.num_placeholders = 0
        # generate | embed | score (shared.protocol.TASKS); embed and score requests are prefill
        # only and finish with their pooled vector (float32 bytes) or score.
        self.task = task
        self.embedding: bytes | None = None
        self.score: float | None = None
        # The LoRA adapter it runs under (None: the base model), and its slot while running (0: none held).
        self.lora_name = lora_name
        self.lora_slot = 0
        # The scheduler's lane it runs in (pipeline parallelism: ``Scheduler.num_lanes``).
        self.lane = 0
        # Its prompt's images (``shared.protocol.ImageInput``, in prompt order); None: text only.
        self.images = images

    @property
    def ready(self) -> bool:
        """False while its grammar is still compiling, or (preempted) while a token it sampled is
        still on the device: the scheduler leaves it waiting."""
        return (self.grammar is None or self.grammar.ready) and not self.num_placeholders

    @property
    def pooled(self) -> bool:
        """Prefill only: the result is the last position's hidden state or logits, no token."""
        return self.task != "generate"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens and those still on the device: where the next step's tokens start from."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def output_position(self) -> int:
        """The index among its outputs of the token this request samples next."""
        return len(self.token_ids) + self.num_placeholders - self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class WaitingPlaces:
    """Counts requests against the waiting queue's cap, a client request's members all or none.

    Every prompt (and choice) of a client request is a request, sent one
    after another as one ``group``. Its first member decides for all: it
    reserves places for the rest, or is refused and so are they. One
    request asking for more than the queue holds thus never holds places
    that requests beside it needed, only to be refused on a later member.
    """

    def __init__(self, cap: int):
        self.cap = cap
        # Client requests whose later members are still to arrive: group -> (members left, refused),
        # and the waiting places reserved for them.
        self._groups: dict[str, tuple[int, bool]] = {}
        self._reserved = 0

    def take(self, group: str | None, group_size: int, num_waiting: int) -> None:
        """Count one request while ``num_waiting`` wait; raises OverloadedError past the cap."""
        cap = self.cap
        entry = self._groups.get(group) if group is not None else None
        if entry is not None:  # a later member: its fate was decided by the first
            left, refused = entry
            if left > 1:
                self._groups[group] = (left - 1, refused)
            else:
                del self._groups[group]
            if refused:
                raise OverloadedError(f"this request's {group_size} prompts x choices do not fit the waiting "
                                      f"queue (--max-waiting-requests {cap}); retry later")
            self._reserved -= 1
            return
        need = max(1, group_size)
        waiting = num_waiting + self._reserved
        refused = waiting + need > cap
        if group is not None and need > 1:
            self._groups[group] = (need - 1, refused)
            if not refused:
                self._reserved += need - 1
        if refused:
            raise OverloadedError(
                f"{waiting} requests are already waiting and this one needs {need} places "
                f"(--max-waiting-requests {cap}); retry later" if need > 1 else
                f"{waiting} requests are already waiting (--max-waiting-requests {cap}); retry later"
            )


def check_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                 pooled: bool) -> None:
    """Raise if a prompt or its sampling parameters can never run on this model. A pooled (embed or
    score) request may fill the context: it generates nothing after its prompt."""
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty")
    params.validate(vocab_size)
    n = len(prompt_token_ids)
    if n > max_model_len or (n == max_model_len and not pooled):
        raise ContextLengthError(f"this model's maximum context length is {max_model_len} tokens; "
                                 f"the prompt has {n} tokens")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise InvalidRequestError("prompt token ids out of range")


def take_output(req: Request) -> RequestOutput:
    """What the request produced since the last call, handed out once."""
    out = RequestOutput(
        request_id=req.request_id,
        new_token_ids=req.pending_tokens,
        finish_reason=req.finish_reason,
        logprobs=req.pending_logprobs or None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        stop_token_id=req.stop_token_id,
        embedding=req.embedding,
        score=req.score,
    )
    req.pending_tokens, req.pending_logprobs = [], []
    return out
