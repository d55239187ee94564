"""How rank 0 talks to the other ranks of a pipeline or tensor-parallel group: its messages, over the group.

Once per forward rank 0 sends every other rank one ``Message``: the journal
of its KV manager's calls since the last one (``Op``, replayed by each
worker's ``pipeline.Mirror``), then the forward's tokens or a query. It goes
over the group's own ``mx.distributed`` send/recv (``Link``); all-gathers
answer the queries. While nothing is in flight the other ranks rest on a
doorbell (``engined.parallel.doorbell``) instead of waiting in MLX's receive.
"""

from __future__ import annotations

import mlx.core as mx
import msgspec
import numpy as np

from mlxd.engined.parallel import doorbell


class Op(msgspec.Struct, array_like=True):
    """One journaled KV call, with the request's progress at the time it was made."""

    kind: str  # create | prefix | allocate | commit | free | sched | step | shrink
    rid: str = ""
    computed: int = 0  # the request's num_computed_tokens
    num_tokens: int = 0  # its len(token_ids)
    count: int = 0  # allocate: new tokens; sched: tokens this step; create: blocks
    blocks: list[int] = []  # allocate: the cached prefix's block ids; create: [resident] or []
    tokens: list[int] = []  # the request's token ids the other ranks do not have yet
    salt: bytes | None = None  # its cache salt, on its first call (and its first after a free)


class Message(msgspec.Struct, array_like=True):
    """What rank 0 sends the other ranks: the journal since the last message, then a forward or a query."""

    ops: list[Op]
    pieces: list[list[int]] | None = None  # the forward's token pieces (ModelRunner.run)
    num_logits: list[int] = []
    # "blocks": every rank says the pool it affords (``Link.smallest``); "rest": nothing is in flight,
    # wait for the doorbell before the next message (``Link.rest``)
    query: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Message).decode



class Link:
    """Rank 0's messages to the other ranks, over the group's own send/recv.

    Each message is passed along the ring: rank 0 to the last rank (the first
    layers, which starts computing once it has passed it on), that one to the
    one before it, and so on down to rank 1. Every hop is between neighbours,
    all MLX's ring backend can send over, and each rank gets a message before
    the hidden states of its forward (the same channel, in that order).
    """

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        rank, size = group.rank(), group.size()
        self.source = (rank + 1) % size  # where this rank's messages come from (a worker's)
        self.onward = size - 1 if rank == 0 else rank - 1 if rank > 1 else None  # where they go on to
        self.doorbell: doorbell.Doorbell | None = None
        self.resting = False  # rank 0: the other ranks wait for the doorbell

    def connect(self, timeout: float) -> None:
        """Return once every rank has called this (each has loaded its part of the model, say), with
        the doorbell that wakes resting ranks set up where the launcher gave rank 0's address."""
        self.doorbell = doorbell.connect(self.group.rank(), self.group.size(), self.exchange, timeout)

    def send(self, message: Message) -> None:
        if self.resting:  # wake them first: the message goes on into their receive
            self.doorbell.ring()
            self.resting = False
        data = np.frombuffer(_encode(message), dtype=np.uint8)
        self._pass_on(mx.array([data.size], dtype=mx.int64), mx.array(data))

    def _pass_on(self, head: mx.array, body: mx.array) -> None:
        # One evaluation per array: sends evaluated together may reach a rank in either order.
        for a in (head, body):
            mx.eval(mx.distributed.send(a, self.onward, group=self.group))

    def receive(self) -> Message:
        head = mx.distributed.recv((1,), mx.int64, self.source, group=self.group)
        mx.eval(head)
        body = mx.distributed.recv((int(head.item()),), mx.uint8, self.source, group=self.group)
        mx.eval(body)
        if self.onward is not None:
            self._pass_on(head, body)
        return _decode(np.array(body).tobytes())

    @property
    def can_rest(self) -> bool:
        """Rank 0: whether ``rest`` would let the other ranks rest (they have a doorbell, and are awake)."""
        return self.doorbell is not None and not self.resting

    def rest(self, message: Message) -> None:
        """Rank 0, with nothing in flight: send ``message`` (query "rest"), after which the other ranks
        wait for the doorbell, which the next ``send`` rings."""
        assert self.can_rest and message.query == "rest"
        self.send(message)
        self.resting = True

    def wait(self) -> bool:
        """A worker told to rest: block until rank 0 rings (True) or is gone (False)."""
        return self.doorbell.wait()

    def exchange(self, values: list[int]) -> np.ndarray:
        """Every rank's ``values``, one row per rank (every rank calls this at the same point)."""
        gathered = mx.distributed.all_gather(mx.array(values, dtype=mx.int64), group=self.group)
        return np.array(gathered).reshape(self.group.size(), len(values))

    def smallest(self, value: int) -> int:
        """The least of every rank's ``value`` (every rank calls this at the same point)."""
        return int(self.exchange([value]).min())
