"""Running one bucket of a compiled model as a pipeline of stages on cores and CPU workers.

The top graph calls one submodule per partition. Accelerator stages run on the thread
of the core the batch was given; CPU stages run in a shared CPU pool. Each stage is
handed to its thread and awaited, so while one batch is in a CPU stage its core is free for another batch's
accelerator stage. A CPU stage that takes less time than a hand-over between threads
(the runner times it at load) runs in place, on the thread that ran the stage before
it. The graph is walked by the model's own interpreter (:mod:`neuron_serve.model.graph`),
the one the plain call uses.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..model import Bucket, graph
from ..targets.pjrt import on_this_thread, use_device
from .cores import Core, CorePool
from .observer import RuntimeObserver


class Pipeline:
    """One bucket loaded onto every core of a pool.

    A replicated bucket is loaded whole on every core. A pipelined bucket's stage at
    offset k (``Partition.core``) is loaded on core k of every group of ``span`` cores
    (the first ``copies`` groups); a chunk given the group's first core runs stage k on
    core first + k, so chunks in flight overlap: one in stage 1 while the next is in stage 0.
    """

    def __init__(self, bucket: Bucket, cores: CorePool, cpu_pool: Executor, observer: RuntimeObserver | None = None,
                 span: int = 1, copies: int | None = None, load_here: bool = False):
        self.bucket = bucket
        self.cores = cores
        self.cpu_pool = cpu_pool
        self.observer = observer  # told of each stage's inputs (transfer) and time (stage)
        self.stages = {p.name for p in bucket.partitions if p.is_stage}
        self.devices = {p.name: p.device for p in bucket.partitions}
        self.offset = {p.name: p.core for p in bucket.partitions}
        gm = bucket.graph_module
        accel = [p for p in bucket.partitions if not p.on_cpu]
        groups = len(cores.cores) // span if copies is None else copies
        self.modules: list[dict[str, torch.nn.Module]] = [{} for _ in cores.cores]
        for lead in range(0, groups * span, span):
            for p in accel:
                core = cores.cores[lead + p.core]
                load = functools.partial(gm.get_submodule(p.name).load_to, core.device)
                # Each core's copy is compiled on that core's own thread (its default device), or, with
                # load_here (a model joining while the cores serve), on this thread, whose default
                # device is put back after: the copy then replays on its core's thread all the same.
                self.modules[core.index][p.name] = on_this_thread(load) if load_here else core.submit(load).result()
        self.cpu_modules = {p.name: gm.get_submodule(p.name) for p in bucket.partitions if p.on_cpu}
        self.in_place: frozenset[str] = frozenset()  # CPU stages run where the previous stage ran (run_in_place)

    def _place(self, name: str, lead: Core) -> tuple[Core, torch.nn.Module | None]:
        """The core that runs partition ``name`` of a chunk led by ``lead``, and its module there (None: CPU)."""
        core = self.cores.cores[lead.index + self.offset[name]]
        return core, self.modules[core.index].get(name)

    async def run(self, flat: list[torch.Tensor], core: Core, inline: bool = False) -> list[torch.Tensor]:
        """Run one chunk (flat inputs of the bucket's batch size) on the cores led by ``core``.

        ``inline`` runs every stage on the calling thread (the event loop's), blocking it:
        for a lone chunk on an idle replica, where handing each stage to its thread and
        back would cost more than the loop has to do meanwhile (see ``ModelRunner.infer``).
        """
        loop = asyncio.get_running_loop()
        walk = graph.stages(self.bucket.graph_module, flat)
        try:
            step: tuple | _Done = next(walk)
        except StopIteration as done:
            return done.value
        while not isinstance(step, _Done):
            name, args = step
            on, module = self._place(name, core)
            if self.observer is not None and name in self.stages:
                self.observer.transfer(name, on.index, sum(a.nbytes for a in args if isinstance(a, torch.Tensor)))
            started = time.perf_counter()
            if module is not None:  # an execution on the core, counted in its activity
                executor, job = on.executor, functools.partial(on.execute, _call, module, args)
            else:
                executor, job = self.cpu_pool, functools.partial(_call, self.cpu_modules[name], args)
            if inline:
                if module is not None:
                    use_device(on.device)  # an executable runs on its calling thread's default device
                step = self._then(walk, job, name, on.index, started)
            else:
                step = await loop.run_in_executor(executor, self._then, walk, job, name, on.index, started)
        return step.outputs

    def _then(self, walk: graph.Stages, job: Callable[[], Any], name: str, core: int, started: float) -> tuple | _Done:
        """On a worker thread: run ``job`` (stage ``name``), then the in-place CPU stages after it.

        Returns the next stage to hand out, or the chunk's outputs.
        """
        result = job()
        observer = self.observer
        while True:
            if observer is not None:
                observer.stage(name, self.devices[name], core, time.perf_counter() - started)
            try:
                name, args = walk.send(result)
            except StopIteration as done:
                return _Done(done.value)
            if name not in self.in_place:
                return name, args
            started = time.perf_counter()
            result = _call(self.cpu_modules[name], args)

    def run_blocking(self, flat: list[torch.Tensor], core: Core, times: dict[str, float] | None = None
                     ) -> list[torch.Tensor]:
        """:meth:`run` from a thread without an event loop (the runner's load-time timing); each stage
        in its own executor. ``times``, if given, gets each CPU stage's warm seconds
        (:func:`_warm_timed_call`: repeat calls, so this run takes longer than a plain one)."""

        def stage(name: str, args: tuple) -> Any:
            on, module = self._place(name, core)
            if module is not None:
                return on.executor.submit(_call, module, args).result()
            module = self.cpu_modules[name]
            if times is None:
                return self.cpu_pool.submit(_call, module, args).result()
            result, times[name] = self.cpu_pool.submit(_warm_timed_call, module, args).result()
            return result

        return graph.run(self.bucket.graph_module, flat, stage)

    def run_in_place(self, names: set[str]) -> None:
        """Run these CPU stages on the thread that ran the stage before them, not in the CPU pool."""
        unknown = names - set(self.cpu_modules)
        if unknown:
            raise ValueError(f"run_in_place: {sorted(unknown)} are not CPU stages of this bucket")
        self.in_place = frozenset(names)


@dataclass
class _Done:
    outputs: list


WARM_CALLS = 3  # repeat calls that time a CPU stage once its code and data are in the caches


def _warm_timed_call(module: torch.nn.Module, args: tuple) -> tuple[Any, float]:
    """A CPU stage's result and the seconds of its fastest repeat call, on copies of ``args``.

    The first call after an accelerator stage finds its code and inputs out of the caches
    and costs several times what the stage costs (the example MLP's sort of 10 scores: 45
    to 130 µs at load against 5 µs warm), and that first call costs the same wherever
    the stage runs. The repeats measure the stage's own work, which is what running it in
    place puts in front of the core's next call. Copies, in case the stage writes its inputs.
    """
    result = _call(module, args)
    fastest = float("inf")
    for _ in range(WARM_CALLS):
        copies = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        started = time.perf_counter()
        _call(module, copies)
        fastest = min(fastest, time.perf_counter() - started)
    return result, fastest


def _call(module: torch.nn.Module, args: tuple) -> Any:
    with torch.no_grad():
        return module(*args)
