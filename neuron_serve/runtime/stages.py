"""Running a pipeline plan: stage k on core k, chunks flowing through the stages concurrently.

Each stage has its own thread (torch-xla runs a thread's work on that thread's default
device) and an input queue; while stage 1 runs chunk i, stage 0 already runs chunk i+1.
Activations move between cores through host memory, which every PJRT backend allows.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from typing import Any

import torch
import torch.fx

from ..partition.pipeline import PipelinePlan
from ..targets.pjrt import use_device, xla

_DONE = object()


def _segments(top: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """The top graph's nodes grouped per stage: a stage's call plus the getitems that follow it."""
    segments: list[list[torch.fx.Node]] = []
    for node in top.graph.nodes:
        if node.op == "call_module":
            segments.append([node])
        elif node.op == "call_function" and segments:
            segments[-1].append(node)
    return segments


def _to(value: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("cpu").to(device), value)


def run_pipeline(plan: PipelinePlan, chunks: list[tuple[torch.Tensor, ...]],
                 timeline: list[tuple[int, int, str, float, float]] | None = None) -> list[Any]:
    """Run every chunk through the plan's stages on their cores; outputs come back on CPU, in order.

    ``timeline``, when given, receives (stage, chunk, device of the stage's output, start, end)
    per stage run, perf_counter seconds: the per-stage times and the overlap between stages.
    """
    top = plan.module
    devices = [xla().device(s.core) for s in plan.stages]
    # Copies: the stages share parameters with the user's module, which must stay on CPU.
    subs = [copy.deepcopy(getattr(top, s.name)).to(d) for s, d in zip(plan.stages, devices)]
    segments = _segments(top)
    placeholders = [n for n in top.graph.nodes if n.op == "placeholder"]
    output = next(n for n in top.graph.nodes if n.op == "output")
    queues = [queue.Queue() for _ in range(len(segments) + 1)]
    errors: list[BaseException] = []

    def stage(k: int) -> None:
        use_device(devices[k])
        chunk = -1
        while (env := queues[k].get()) is not _DONE:
            chunk += 1
            start = time.perf_counter()
            try:
                if env is not None:
                    for node in segments[k]:
                        args = _to(torch.fx.node.map_arg(node.args, lambda n: env[n]), devices[k])
                        if node.op == "call_module":
                            with torch.no_grad():
                                env[node] = subs[k](*args)
                            # Waiting (only when timed) makes the end time the stage's, not the dispatch's.
                            xla().sync(wait=timeline is not None)
                            out = torch.utils._pytree.tree_leaves(env[node])[0]
                        else:
                            env[node] = node.target(*args)
                    if timeline is not None:
                        timeline.append((k, chunk, str(out.device), start, time.perf_counter()))
            except BaseException as e:  # noqa: BLE001 - reported to the caller below
                errors.append(e)
                env = None
            queues[k + 1].put(env)
        queues[k + 1].put(_DONE)

    threads = [threading.Thread(target=stage, args=(k,), daemon=True) for k in range(len(segments))]
    for t in threads:
        t.start()
    for chunk in chunks:
        queues[0].put(dict(zip(placeholders, chunk)))
    queues[0].put(_DONE)
    results = []
    while (env := queues[-1].get()) is not _DONE:
        if env is not None:
            results.append(_to(torch.fx.node.map_arg(output.args[0], lambda n: env[n]), torch.device("cpu")))
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
