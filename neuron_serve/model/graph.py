"""The one interpreter of a partitioned model's top graph.

The top graph holds placeholders, one ``call_module`` per partition, ``getitem``s
picking a partition's outputs apart, and the output. :func:`stages` walks it as a
generator: it yields ``(partition name, args)`` for each stage and is sent the
stage's result back. Who runs a stage, and how, is the caller's business: the plain
call runs it in place (:func:`run`), the serving pipeline hands it to a core or the
CPU pool and advances the walk there, the compiler compiles it first and the
profiler times it.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Generator

import torch.fx

Stages = Generator[tuple[str, tuple], Any, list]


def stages(gm: torch.fx.GraphModule, flat: list[Any]) -> Stages:
    """Walk the top graph of ``gm`` on ``flat`` inputs; see the module docstring."""
    env: dict[torch.fx.Node, Any] = {}
    inputs = iter(flat)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(inputs)
        elif node.op == "call_module":
            env[node] = yield node.target, torch.fx.node.map_arg(node.args, env.__getitem__)
        elif node.op == "call_function" and node.target is operator.getitem:
            source, index = node.args
            env[node] = env[source][index]
        elif node.op == "get_attr":
            env[node] = getattr(gm, node.target)
        elif node.op == "output":
            return list(torch.fx.node.map_arg(node.args[0], env.__getitem__))
        else:
            raise TypeError(f"the top graph has a {node.op} node ({node.name}); it may only call partitions")
    raise TypeError("the top graph has no output node")


def run(gm: torch.fx.GraphModule, flat: list[Any], call: Callable[[str, tuple], Any]) -> list:
    """Run the top graph, each stage by ``call(name, args)``; returns the flat outputs."""
    walk = stages(gm, flat)
    try:
        step = next(walk)
        while True:
            step = walk.send(call(*step))
    except StopIteration as done:
        return done.value


def call_submodule(gm: torch.fx.GraphModule) -> Callable[[str, tuple], Any]:
    """The plain way to run a stage: call ``gm``'s submodule of that name.

    Its ``forward``, not ``__call__``: while a compile runs on the compile queue's thread, torch.export's
    tracer patches ``nn.Module.__call__`` for every thread, and a stage called through it from a serving
    thread would be traced into that compile instead of run."""
    def call(name: str, args: tuple) -> Any:
        return gm.get_submodule(name).forward(*args)

    return call
