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


class Pipeline:
    """One bucket loaded onto every core of a pool."""

    def __init__(self, bucket: Bucket, cores: CorePool, cpu_pool: Executor, on_stage: StageTimer | None = None):
        self.bucket = bucket
        self.cpu_pool = cpu_pool
        self.on_stage = on_stage
        self.devices = {p.name: p.device for p in bucket.partitions}
        gm = bucket.graph_module
        accel = {p.name: gm.get_submodule(p.name) for p in bucket.partitions if not p.on_cpu}
        self.modules: list[dict[str, torch.nn.Module]] = []
        for core in cores.cores:
            # Compile each core's copy on that core's own thread (its default device).
            self.modules.append({name: core.submit(sub.load_to, core.device).result() for name, sub in accel.items()})
        self.cpu_modules = {p.name: gm.get_submodule(p.name) for p in bucket.partitions if p.on_cpu}

    async def run(self, flat: list[torch.Tensor], core: Core) -> list[torch.Tensor]:
        """Run one chunk (flat inputs of the bucket's batch size) with ``core`` for its accelerator stages."""
        loop = asyncio.get_running_loop()
        on_core = self.modules[core.index]

        async def stage(name: str, args: tuple) -> Any:
            module = on_core.get(name)
            started = time.perf_counter()
            if module is not None:  # an execution on the core, counted in its activity
                result = await loop.run_in_executor(core.executor, core.execute, _call, module, args)
            else:
                result = await loop.run_in_executor(self.cpu_pool, _call, self.cpu_modules[name], args)
            if self.on_stage:
                self.on_stage(name, self.devices[name], core.index, time.perf_counter() - started)
            return result

        return await graph.run_async(self.bucket.graph_module, flat, stage)

    def run_blocking(self, flat: list[torch.Tensor], core: Core) -> list[torch.Tensor]:
        """:meth:`run` from a thread without an event loop (the runner's load-time timing)."""
        on_core = self.modules[core.index]

        def stage(name: str, args: tuple) -> Any:
            module, executor = on_core.get(name), core.executor
            if module is None:
                module, executor = self.cpu_modules[name], self.cpu_pool
            return executor.submit(_call, module, args).result()

        return graph.run(self.bucket.graph_module, flat, stage)


def _call(module: torch.nn.Module, args: tuple) -> Any:
    with torch.no_grad():
        return module(*args)
