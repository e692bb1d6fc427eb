"""The LoRA adapters one engine serves: known by name, read on the host, held in the core's buffer slots.

An adapter is *known* once added (``generation.lora.lora_modules`` at start, or loaded while
serving); it is *read* (``lora.read_adapter``: checked against the base, laid out at
``max_lora_rank``) when added, and its laid-out weights are kept on the host for at most
``max_cpu_loras`` adapters, the least recently used dropped (read again when next asked for).
A request's adapter must be *resident*: in one of the ``max_loras`` slots of the buffers on
the core (slot 0 is the base, all zeros). Putting it there writes that slot, never compiles;
the slot taken is a free one, else the least recently used one no running sequence uses.
When every slot is used by running sequences, the request waits (it is not admitted) until
one ends: nothing fails.

An unloaded adapter first *retires*: refused to new requests, still known to the ones an engine
already took (running or waiting for a slot), and removed when the last of them ends: requests
are counted from their submission (:meth:`take`) to their end (:meth:`done`), so the adapter's
whole life is here (:meth:`unload`).

``acquire`` and ``release`` run on the engine's thread (the buffers are written between its
calls); ``add``, ``take``, ``done`` and ``unload`` may come from any thread (a load route): an adapter is read
and checked on the caller's thread, then known under the lock.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable

from ...errors import AdapterError, AdapterNotLoaded
from . import layers as lora_layers
from .adapter import LoraAdapter, LoraBase, read_adapter

_loads = itertools.count(1)


@dataclass(frozen=True)
class AdapterPolicy:
    """How an engine holds adapters: checked against ``base``; ``max_loras`` on the core at ``max_lora_rank``,
    ``max_cpu_loras`` kept read on the host (generation.lora's settings)."""

    base: LoraBase
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int

    @classmethod
    def of(cls, lm: Any, settings: Any, tensor_parallel_size: int = 1) -> "AdapterPolicy":
        """For causal LM ``lm`` under ``settings`` (config.generation.LoraSettings)."""
        return cls(LoraBase.of(lm, tensor_parallel_size), settings.max_loras, settings.max_lora_rank,
                   settings.max_cpu_loras)

    @property
    def layout(self) -> lora_layers.Layout:
        """The buffers every compiled model takes: every projection an adapter may target, ``max_loras`` slots."""
        return lora_layers.Layout(self.max_loras, self.max_lora_rank, self.base.projections)


class Adapters:
    """See the module docstring. ``model`` holds the buffers (``write_adapter``: a GenerationModel, or the
    executor in front of it)."""

    def __init__(self, model: Any, policy: AdapterPolicy) -> None:
        self.model = model
        self.base = policy.base
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = policy.max_loras, policy.max_lora_rank, \
            policy.max_cpu_loras
        self._lock = threading.Lock()
        self.paths: dict[str, str] = {}  # every adapter known, by name -> its directory
        self._keys: dict[str, Hashable] = {}  # name -> what a prefix computed under it is cached as (per load)
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # read, least recently used first
        self._resident: dict[str, int] = {}  # name -> its buffer slot (1..max_loras)
        self._users: Counter[int] = Counter()  # buffer slot -> running sequences using it
        self._idle: OrderedDict[int, str] = OrderedDict()  # resident and unused: slot -> name, least recent first
        self._dropped: set[int] = set()  # slots of adapters removed while in use: freed when the last user ends
        self.retiring: set[str] = set()  # unloaded, kept for the requests taken before: refused to new ones
        self._requests: Counter[str] = Counter()  # name -> requests taken and not ended (waiting or running)
        self.writes = 0  # adapters written into a slot (each a load onto the core, no compile)

    # -- known adapters ----------------------------------------------------------------------

    def add(self, name: str, path: str | Path) -> LoraAdapter:
        """Know adapter ``name`` at ``path``, read and checked now (AdapterError names the file and the reason);
        an adapter of that name already known is replaced for the requests that come next."""
        adapter = read_adapter(name, path, self.base, max_lora_rank=self.max_lora_rank)
        with self._lock:
            if name in self.paths:
                self._remove(name)
            self.paths[name] = str(path)
            self._keys[name] = (name, next(_loads))
            self._keep(adapter)
        return adapter

    def take(self, name: str) -> Hashable:
        """A request names adapter ``name``: counted until it is :meth:`done`; what its prefix is cached under.
        AdapterNotLoaded if the adapter is not known or is retiring."""
        with self._lock:
            if name not in self.paths or name in self.retiring:
                raise AdapterNotLoaded(f"adapter {name!r} is not loaded.")
            self._requests[name] += 1
            return self._keys[name]

    def done(self, name: str) -> None:
        """A request taken on adapter ``name`` ended: the last one of a retiring adapter removes it."""
        with self._lock:
            self._requests[name] -= 1
            if self._requests[name] <= 0:
                del self._requests[name]
                if name in self.retiring:
                    self._remove(name)

    def unload(self, name: str) -> None:
        """Stop serving adapter ``name`` to new requests: retired while requests taken on it have not ended,
        else removed now. KeyError if it is not loaded."""
        with self._lock:
            if name not in self.paths or name in self.retiring:
                raise KeyError(name)
            if self._requests[name]:
                self.retiring.add(name)
            else:
                self._requests.pop(name, None)
                self._remove(name)

    def _remove(self, name: str) -> None:
        self.retiring.discard(name)
        self.paths.pop(name, None)
        self._keys.pop(name, None)
        self._host.pop(name, None)
        slot = self._resident.pop(name, None)
        if slot is None:
            return
        if self._users[slot]:
            self._dropped.add(slot)
        else:
            self._idle.pop(slot, None)

    def key(self, name: str | None) -> Hashable:
        """What a prefix computed under adapter ``name`` is cached as (None: the base); KeyError if not known."""
        with self._lock:
            return None if name is None else self._keys[name]

    def __contains__(self, name: str) -> bool:
        """Whether a new request may name adapter ``name`` (known, and not retiring)."""
        with self._lock:
            return name in self.paths and name not in self.retiring

    # -- slots on the core -------------------------------------------------------------------

    def acquire(self, name: str) -> int | None:
        """The buffer slot holding adapter ``name`` for one more running sequence (written there first if it is
        not resident); None while every slot is in use (the sequence waits). KeyError if it is not known."""
        with self._lock:
            return self._acquire(name)

    def _acquire(self, name: str) -> int | None:
        if name not in self.paths:
            raise KeyError(name)
        slot = self._resident.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self.model.write_adapter(slot, self._read(name))
            self.writes += 1
            self._resident[name] = slot
        self._idle.pop(slot, None)
        self._users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """One running sequence using buffer slot ``slot`` ended."""
        with self._lock:
            self._release(slot)

    def _release(self, slot: int) -> None:
        self._users[slot] -= 1
        if self._users[slot]:
            return
        del self._users[slot]
        if slot in self._dropped:
            self._dropped.discard(slot)
        else:
            self._idle[slot] = next(name for name, s in self._resident.items() if s == slot)

    @property
    def resident(self) -> dict[str, int]:
        """Adapters on the core: name -> buffer slot."""
        with self._lock:
            return dict(self._resident)

    def _free_slot(self) -> int | None:
        taken = set(self._resident.values()) | self._dropped
        free = [slot for slot in range(1, self.max_loras + 1) if slot not in taken]
        if free:
            return free[0]
        if not self._idle:
            return None
        slot, name = self._idle.popitem(last=False)  # the least recently used idle adapter leaves the core
        del self._resident[name]
        return slot

    def _read(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is None:
            try:
                adapter = read_adapter(name, self.paths[name], self.base, max_lora_rank=self.max_lora_rank)
            except AdapterError:  # changed on disk since it was added: it stays refused until added again
                self._remove(name)
                raise
        self._keep(adapter)
        return adapter

    def _keep(self, adapter: LoraAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
