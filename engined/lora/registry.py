"""The adapters an engine serves: which are known, which sit in device slots, and each token's slot per step.

``register`` reads an adapter (``adapters.read_adapter``), checks every module
against the wrapped model (``layers.install``) and keeps its weights in host
memory. A request names an adapter; when the scheduler admits it, ``acquire``
gives it a slot (1..``max_loras``), writing the weights into the stacks if the
adapter is not resident, evicting the least recently used slot that no
running request holds. When every slot is held by running requests the
request waits (vLLM's ``max_loras`` bound on the adapters of one batch).
Slot 0 is the base model. ``set_step`` gives the layers the runner's per-token slots.

Host copies (float32, as read) are kept for at most ``max_cpu_loras`` adapters,
least recently used dropped first (vLLM's ``--max-cpu-loras``); an adapter
without one is read again from disk when it next takes a slot, and refused
(InvalidRequestError: the request fails alone) if its files changed since it was
loaded: its KV blocks in the prefix cache belong to the old weights.
``fixed_bytes`` bounds those copies for the memory guard.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.engined.device import on_cpu
from mlxd.engined.lora import layers
from mlxd.engined.lora.adapters import CONFIG, MLX_WEIGHTS, PEFT_WEIGHTS, AdapterWeights, read_adapter
from mlxd.shared.errors import InvalidRequestError, MlxdError, NotFoundError


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    num_modules: int
    # Enters the prefix-cache salt: a digest of what the adapter computes, so a changed adapter never
    # meets the old one's blocks and the same one finds its blocks again (on disk, after a restart).
    uid: str
    # The files' (name, size, mtime) when read: a re-read from disk must find the same.
    stamp: tuple


def _digest(weights: AdapterWeights) -> str:
    """Of an adapter's modules and their weights (the scale folded in): all that changes its K/V."""
    h = hashlib.blake2b(digest_size=16, person=b"mlxd-lora")
    for module in sorted(weights.modules):
        h.update(module.encode() + b"\x00")
        for array in weights.modules[module]:
            h.update(str(array.shape).encode())
            h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def _stamp(path: str) -> tuple:
    out = []
    for name in (CONFIG, MLX_WEIGHTS, PEFT_WEIGHTS):
        try:
            st = os.stat(os.path.join(path, name))
        except FileNotFoundError:
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


class LoraRegistry:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, dtype: mx.Dtype,
                 max_cpu_loras: int | None = None, term_kernel: bool = False):
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        # MLX's CPU gather_mm takes float32 only: a half-precision model's expert adapters run in float32 there.
        self.step, self.targets = layers.install(model, max_loras, max_lora_rank, dtype,
                                                 mx.float32 if on_cpu() else dtype, term_kernel)
        self.adapters: dict[str, Adapter] = {}
        # name -> its weights in host memory, at most max_cpu_loras; most recently used last.
        self._host: OrderedDict[str, AdapterWeights] = OrderedDict()
        # slot -> adapter name (slot 0, the base, is never listed); most recently used last.
        self._resident: OrderedDict[int, str] = OrderedDict()
        self._holders: dict[int, int] = {}  # slot -> running requests holding it
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        """The slot stacks of every wrapped layer, each once."""
        return [a for w in self._wrappers() for a in w.stacks()]

    def _wrappers(self) -> list[nn.Module]:
        return list({id(w): w for w, _ in self.targets.values()}.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the slots' A and B (weights the memory guard counts)."""
        return sum(w.nbytes for w in self._wrappers())

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies now."""
        return sum(w.nbytes for w in self._host.values())

    # The memory guard's store interface (``memory_guard.plan``): the host copies are a pool of fixed size.
    bytes_per_block = resize_bytes_per_block = 0

    @property
    def fixed_bytes(self) -> int:
        """The most the host copies can take where host and device share memory (MLX's CPU backend,
        Apple silicon): ``max_cpu_loras`` adapters of full rank on every target, float32; 0 on CUDA,
        whose device memory they do not touch."""
        if mx.cuda.is_available() and not on_cpu():
            return 0
        r = self.max_lora_rank
        shapes = [wrapper.expected_shapes(proj, r) if proj else wrapper.expected_shapes(r)
                  for wrapper, proj in self.targets.values()]
        return self.max_cpu_loras * int(sum(np.prod(a) + np.prod(b) for a, b in shapes)) * 4

    # -- the adapters known --------------------------------------------------------------

    def register(self, name: str, path: str) -> Adapter:
        """Read and check an adapter and serve it as ``name``; errors name the problem (400/404)."""
        if not name or name in self.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded" if name else
                                      "a LoRA adapter needs a name", param="lora_name")
        weights = read_adapter(path)
        self._check(weights)
        adapter = Adapter(name, weights.path, weights.rank, len(weights.modules), _digest(weights),
                          _stamp(weights.path))
        self.adapters[name] = adapter
        self._keep(name, weights)
        return adapter

    def unregister(self, name: str, in_use: int) -> None:
        """Stop serving ``name``; refused while ``in_use`` requests (waiting or running) still name it."""
        if name not in self.adapters:
            raise NotFoundError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        if in_use:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {in_use} request(s); unload it "
                                      "when they have finished", param="lora_name")
        del self.adapters[name]
        self._host.pop(name, None)
        for slot, held in list(self._resident.items()):
            if held == name:
                del self._resident[slot]

    def _keep(self, name: str, weights: AdapterWeights) -> None:
        self._host[name] = weights
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _weights(self, name: str) -> AdapterWeights:
        """``name``'s weights: its host copy, or its files read again (unchanged, else InvalidRequestError)."""
        weights = self._host.get(name)
        adapter = self.adapters[name]
        if weights is None:
            where = f"LoRA adapter {name!r} ({adapter.path})"
            if _stamp(adapter.path) != adapter.stamp:
                raise InvalidRequestError(f"{where} changed on disk since it was loaded; unload it and load it "
                                          "again", param="model")
            try:
                weights = read_adapter(adapter.path)
                self._check(weights)
            except MlxdError as e:
                raise InvalidRequestError(f"{where} could not be read again: {e.message}", param="model") from None
        self._keep(name, weights)
        return weights

    def _check(self, w: AdapterWeights) -> None:
        where = f"LoRA adapter {w.path!r}"
        if w.rank > self.max_lora_rank:
            raise InvalidRequestError(f"{where} has rank {w.rank}, over --max-lora-rank {self.max_lora_rank}",
                                      param="lora_path")
        for path, (a, b) in w.modules.items():
            target = self.targets.get(path)
            if target is None:
                raise InvalidRequestError(f"{where} adapts {path!r}, which is not a linear layer of this model's "
                                          "transformer layers", param="lora_path")
            wrapper, proj = target
            r = a.shape[-1]
            want = wrapper.expected_shapes(proj, r) if proj else wrapper.expected_shapes(r)
            experts_fit = proj is None or a.shape[0] <= want[0][0]
            got = (a.shape[1:], b.shape[1:]) if proj else (a.shape, b.shape)
            if not experts_fit or got != ((want[0][1:], want[1][1:]) if proj else want):
                raise InvalidRequestError(f"{where}: {path} has LoRA shapes {a.shape} and {b.shape}; the model "
                                          f"needs {want[0]} and {want[1]}", param="lora_path")

    # -- slots ----------------------------------------------------------------------------

    def acquire(self, name: str) -> int | None:
        """A slot holding ``name`` for one more running request, or None while every slot is held.

        InvalidRequestError when ``name`` has no host copy and its files cannot be read again."""
        slot = next((s for s, n in self._resident.items() if n == name), None)
        if slot is None:
            free = [s for s in range(1, self.max_loras + 1) if s not in self._resident]
            idle = [s for s in self._resident if not self._holders.get(s)]
            if not free and not idle:
                return None
            weights = self._weights(name)
            slot = free[0] if free else idle[0]  # _resident is in LRU order
            self._resident.pop(slot, None)
            self._write(slot, weights)
            self._resident[slot] = name
        self._resident.move_to_end(slot)
        self._holders[slot] = self._holders.get(slot, 0) + 1
        return slot

    def release(self, slot: int) -> None:
        """A running request holding ``slot`` finished or was preempted."""
        if slot:
            self._holders[slot] -= 1

    def _write(self, slot: int, w: AdapterWeights) -> None:
        """Put an adapter's weights into ``slot`` of every wrapped layer; zeros where it adapts nothing."""
        touched = []
        for path, (wrapper, proj) in self.targets.items():
            pair = w.modules.get(path)
            touched += wrapper.write(proj, slot, pair) if proj else wrapper.write(slot, pair)
        mx.eval(touched)

    # -- the step -------------------------------------------------------------------------

    def set_step(self, slots: list[int], lens: list[int]) -> None:
        """Set the step's per-token slots from its requests' ``slots`` (``lens`` tokens each); [] clears it."""
        self.step.set(np.repeat(np.asarray(slots, np.uint32), lens))

    def running(self) -> list[str]:
        """Adapters held by running requests now."""
        return sorted({self._resident[s] for s, n in self._holders.items() if n and s in self._resident})
