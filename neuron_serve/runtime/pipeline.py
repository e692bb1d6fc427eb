"""Running a partitioned model as a pipeline of stages on cores and CPU workers.

The top graph of a TracedModule calls one submodule per partition. Accelerator
stages run on the thread of the core the batch was given; CPU stages run in a shared
CPU pool. Each stage is awaited, so while one batch is in a CPU stage its core is
free for another batch's accelerator stage.
"""

from __future__ import annotations

import asyncio
import operator
import time
from concurrent.futures import Executor
from typing import Any, Callable

import torch
import torch.fx

from ..compile.subgraph import CompiledSubgraph
from ..traced import TracedModule
from .cores import Core, CorePool

StageTimer = Callable[[str, str, int, float], None]  # (partition, device, core, seconds)


class Pipeline:
    """One traced model loaded onto every core of a pool."""

    def __init__(self, traced: TracedModule, cores: CorePool, cpu_pool: Executor, on_stage: StageTimer | None = None):
        self.traced = traced
        self.cpu_pool = cpu_pool
        self.on_stage = on_stage
        self.nodes = list(traced.graph_module.graph.nodes)
        self.devices = {p.name: p.device for p in traced.partitions}
        accel = {
            name: module
            for name, module in traced.graph_module.named_children()
            if isinstance(module, CompiledSubgraph)
        }
        self.modules: list[dict[str, torch.nn.Module]] = []
        for core in cores.cores:
            # Compile each core's copy on that core's own thread (its default device).
            loaded = {name: core.submit(sub.load_to, core.device).result() for name, sub in accel.items()}
            self.modules.append(loaded)
        self.cpu_modules = {
            name: module for name, module in traced.graph_module.named_children() if name not in accel
        }

    async def run(self, flat: list[torch.Tensor], core: Core) -> list[torch.Tensor]:
        loop = asyncio.get_running_loop()
        env: dict[torch.fx.Node, Any] = {}
        inputs = iter(flat)
        for node in self.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "call_module":
                args = torch.fx.node.map_arg(node.args, env.__getitem__)
                module = self.modules[core.index].get(node.target)
                started = time.perf_counter()
                if module is not None:  # an execution on the core, counted in its activity
                    env[node] = await loop.run_in_executor(core.executor, core.execute, _call, module, args)
                else:
                    env[node] = await loop.run_in_executor(self.cpu_pool, _call, self.cpu_modules[node.target], args)
                if self.on_stage:
                    self.on_stage(node.target, self.devices[node.target], core.index, time.perf_counter() - started)
            elif node.op == "call_function" and node.target is operator.getitem:
                source, index = node.args
                env[node] = env[source][index]
            elif node.op == "get_attr":
                env[node] = getattr(self.traced.graph_module, node.target)
            elif node.op == "output":
                return list(torch.fx.node.map_arg(node.args[0], env.__getitem__))
        raise RuntimeError("graph has no output node")


def _call(module: torch.nn.Module, args: tuple) -> Any:
    with torch.no_grad():
        return module(*args)
