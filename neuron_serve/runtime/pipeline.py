"""Running one bucket of a compiled model as a pipeline of stages on cores and CPU workers.

The top graph calls one submodule per partition. Accelerator stages run on the thread
of the core the batch was given; CPU stages run in a shared CPU pool. Each stage is
awaited, so while one batch is in a CPU stage its core is free for another batch's
accelerator stage. The graph is walked by the model's own interpreter
(:mod:`neuron_serve.model.graph`), the one the plain call uses.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Any, Callable

import torch

from ..model import Bucket, graph
from .cores import Core, CorePool

StageTimer = Callable[[str, str, int, float], None]  # (partition, device, core, seconds)
TransferHook = Callable[[str, int, int], None]  # (pipeline stage, core, input bytes) per stage run


class Pipeline:
    """One bucket loaded onto every core of a pool.

    A replicated bucket is loaded whole on every core. A pipelined bucket's stage at
    offset k (``Partition.core``) is loaded on core k of every group of ``span`` cores
    (the first ``copies`` groups); a chunk given the group's first core runs stage k on
    core first + k, so chunks in flight overlap: one in stage 1 while the next is in stage 0.
    """

    def __init__(self, bucket: Bucket, cores: CorePool, cpu_pool: Executor, on_stage: StageTimer | None = None,
                 span: int = 1, copies: int | None = None, on_transfer: TransferHook | None = None):
        self.bucket = bucket
        self.cores = cores
        self.cpu_pool = cpu_pool
        self.on_stage = on_stage
        self.on_transfer = on_transfer
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
                # Compile each core's copy on that core's own thread (its default device).
                self.modules[core.index][p.name] = core.submit(gm.get_submodule(p.name).load_to, core.device).result()
        self.cpu_modules = {p.name: gm.get_submodule(p.name) for p in bucket.partitions if p.on_cpu}

    def _place(self, name: str, lead: Core) -> tuple[Core, torch.nn.Module | None]:
        """The core that runs partition ``name`` of a chunk led by ``lead``, and its module there (None: CPU)."""
        core = self.cores.cores[lead.index + self.offset[name]]
        return core, self.modules[core.index].get(name)

    async def run(self, flat: list[torch.Tensor], core: Core) -> list[torch.Tensor]:
        """Run one chunk (flat inputs of the bucket's batch size) on the cores led by ``core``."""
        loop = asyncio.get_running_loop()

        async def stage(name: str, args: tuple) -> Any:
            on, module = self._place(name, core)
            if self.on_transfer and name in self.stages:
                self.on_transfer(name, on.index, sum(a.nbytes for a in args if isinstance(a, torch.Tensor)))
            started = time.perf_counter()
            if module is not None:  # an execution on the core, counted in its activity
                result = await loop.run_in_executor(on.executor, on.execute, _call, module, args)
            else:
                result = await loop.run_in_executor(self.cpu_pool, _call, self.cpu_modules[name], args)
            if self.on_stage:
                self.on_stage(name, self.devices[name], on.index, time.perf_counter() - started)
            return result

        return await graph.run_async(self.bucket.graph_module, flat, stage)

    def run_blocking(self, flat: list[torch.Tensor], core: Core) -> list[torch.Tensor]:
        """:meth:`run` from a thread without an event loop (the runner's load-time timing)."""

        def stage(name: str, args: tuple) -> Any:
            on, module = self._place(name, core)
            executor = on.executor
            if module is None:
                module, executor = self.cpu_modules[name], self.cpu_pool
            return executor.submit(_call, module, args).result()

        return graph.run(self.bucket.graph_module, flat, stage)


def _call(module: torch.nn.Module, args: tuple) -> Any:
    with torch.no_grad():
        return module(*args)
