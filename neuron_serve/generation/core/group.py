"""One engine per core of a replica, each owning a copy of the compiled model and its own cache.

The model compiled on the first core is copied onto the others (each copy compiled for
its core, on the compile queue's thread, and kept up to date with what compiles later);
a request goes to the engine with the most free slots, so load spreads across the cores
as slots fill.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence as Seq

import torch

from ...assembly import host_memory
from ...assembly.queue import READY, compile_queue
from ...config.generation import DEFAULT_MAX_WAITING
from ...targets.pjrt import emulated, on_this_thread, use_device, xla
from .engine import Engine
from ..runner.model import GenerationModel
from ..runner.weights import swap_weights
from ..frontend.protocol import Dispatcher


COMPILE_WAIT_S = 50.0  # at close, for a compile under way (a replica waits 60 s for its engine process to end)


def copies_on_cores(model: GenerationModel, cores: int) -> list[tuple[GenerationModel, Any]]:
    """``model`` (compiled on core 0) and a copy on each further core, with each core's device: loaded on
    the compile queue's thread (loading traces), through the build that compiles its later models."""
    torch_xla = xla()
    placed = [(model, torch_xla.device(0))]
    for index in range(1, cores):
        device = torch_xla.device(index)
        if model.build is not None:
            placed.append((model.build.copy_to(device), device))
            continue
        job = compile_queue().submit(f"load onto {device}", functools.partial(on_this_thread, lambda d=device: (
            use_device(d), model.load_to(d))[1]), priority=READY, kind="load")
        placed.append((job.future.result(), device))
    return placed


def engines_host_memory(models: Seq[GenerationModel], build: Any = None) -> dict:
    """assembly/host_memory.report of the compiled ``models`` (one a core or group) and their drafts."""
    every = [m for model in models for m in (model, model.draft) if m is not None]
    weights = [w for m in every for w in m.held_weights().values()]
    cache = sum(m.memory_per_core()["kv_cache"] * m.tensor_parallel_size + m.memory_per_core().get("lora", 0)
                for m in every)
    compiled = {label: bytes_ for label, bytes_ in (build.compiled_bytes if build is not None else {}).items()
                if bytes_ is not None}
    return host_memory.report(weights, cache, compiled, emulated())


def describe(engines: Seq[Engine], max_waiting: int) -> dict[str, Any]:
    """What the front end needs to know of ``engines`` (alike: copies of one model), ``max_waiting``
    requests of each waiting for a slot at most."""
    first = engines[0]
    executor = first.executor
    return {"engines": len(engines), "slots": executor.slots, "max_waiting": max_waiting,
            "vocab_size": executor.vocab_size, "max_model_len": executor.max_model_len,
            "eos_token_ids": sorted(first.eos_token_ids), "tensor_parallel_size": executor.tensor_parallel_size,
            "memory_per_core": executor.memory(), "precision": executor.precision}


class EngineGroup(Dispatcher):
    """Engines over several cores behind one ``submit``/``abort``; ``max_waiting`` requests per engine may
    wait for a slot (the front end's bound, named in :attr:`info`)."""

    def __init__(self, engines: Seq[Engine], max_waiting: int = DEFAULT_MAX_WAITING, build: Any = None) -> None:
        if not engines:
            raise ValueError("an engine group needs at least one engine")
        super().__init__()
        self.engines = list(engines)
        self.max_waiting = max_waiting
        self.build = build  # what compiles the engines' later models (compiling.GenerationBuild; None: all are)

    @classmethod
    def on_cores(cls, model: GenerationModel, cores: int, max_waiting: int = DEFAULT_MAX_WAITING,
                 **engine_options: Any) -> "EngineGroup":
        """An engine per core, ``model`` on the first and a copy on each of the others; one engine over
        all ``cores`` when ``model`` is tensor-parallel over them."""
        if model.tensor_parallel_size > 1:
            return cls([Engine(model, **engine_options)], max_waiting, model.build)
        return cls([Engine(m, device=device, **engine_options) for m, device in copies_on_cores(model, cores)],
                   max_waiting, model.build)

    @property
    def padding(self) -> dict:
        """What the engines' buckets padded so far (they share one buckets/usage.Usage)."""
        return self.engines[0].usage.summary()

    def choose(self) -> Engine:
        return max(self.engines, key=lambda e: e.free_slots)

    @property
    def info(self) -> dict[str, Any]:
        """What the front end needs to know of these engines (frontend.Frontend)."""
        return describe(self.engines, self.max_waiting)

    @property
    def running(self) -> int:
        return sum(e.running for e in self.engines)

    @property
    def host_memory(self) -> dict:
        """What the process holds of host memory for these engines (assembly/host_memory.report): every core's
        weights (held once each, whatever the compiled models) and cache, the weights' host copy, each compiled
        model's code as it compiled, and the resident set."""
        return engines_host_memory([e.model for e in self.engines], self.build)

    def replace_weights(self, lm: torch.nn.Module) -> int:
        """Serve the weights of ``lm`` (a fine-tune: the same architecture, dtype and quantization) on every engine
        from their next call, without compiling (model.swap_weights). Returns how many weights were replaced."""
        return swap_weights([e.model for e in self.engines], lm, self.build)

    def load_adapter(self, name: str, path: str) -> None:
        """Serve LoRA adapter ``name`` (a PEFT directory) on every engine (Engine.load_adapter)."""
        for engine in self.engines:
            engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        for engine in self.engines:
            engine.unload_adapter(name)

    def close(self, compile_wait: float | None = None) -> None:
        """Stop the engines; the compiles not begun are dropped and the one under way ends before this returns
        (at most ``compile_wait`` seconds: an engine process, which a replica waits for, passes COMPILE_WAIT_S)."""
        if self.build is not None:  # what no engine will run is not compiled
            self.build.compiles.cancel()
        for engine in self.engines:
            engine.close()
        if self.build is not None:
            # A compile under way ends before close returns: a trace the caller starts next in this process would
            # run beside it, and torch.export is not thread-safe ("Trying to pop empty mode stack").
            compiles = self.build.compiles
            if not compiles.queue.on_worker():
                compiles.wait(compiles.jobs(), timeout=compile_wait)
