"""ModelRunner: a built model on the cores of this replica, running request batches.

The runner takes a :class:`~neuron_serve.model.CompiledModel` built elsewhere (by the
serving edge) and learns everything from it: which bucket a request goes to (the
model's kernel), how many rows one compiled call takes (the bucket's batch size), and
how outputs are cut back. Requests of one bucket are concatenated along dim 0, split
into chunks of that batch size (the last padded) and spread over the idle cores
(:class:`~.cores.CorePool`), each chunk a pipeline of core and CPU stages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..buckets import dynamic_batch
from ..errors import ConfigError, NeuronServeError
from ..buckets import batch_sizes
from ..model import Bucket, CompiledModel
from . import lone, request_rows
from .cores import CorePool
from .observer import RuntimeObserver
from .pipeline import Pipeline

logger = logging.getLogger("neuron_serve")

TIMING_ROUNDS = 5  # calls timed per compiled size at load, in turns with the other sizes; the fastest is its cost
# A CPU stage faster than this runs on the thread that ran the stage before it: handing it
# to the CPU pool and back costs about 0.1 ms of thread wake-ups (measured on 2 vCPUs).
IN_PLACE_CPU_S = 100e-6


def _copies(model: CompiledModel, cores: int) -> tuple[int, int]:
    """(cores one copy of the model spans, copies on ``cores`` cores)."""
    span = model.pipeline_span
    if span > cores:
        raise ConfigError(f"the model is pipelined over {span} cores but the replica has {cores}; set "
                          f"cores_per_replica to at least {span}")
    return span, (cores // span if model.saturate_host or span == 1 else 1)


@dataclass(frozen=True)
class _Serving:
    """What requests run on, replaced whole when compiled models join (``ModelRunner.grow``): a
    batch keeps the one it started with, so a bucket index always means the same bucket to it."""

    model: CompiledModel
    # Per shape bucket, compiled batch size -> that bucket at that size, loaded on every core
    # (a pipelined model: each stage on its core of every pipeline copy).
    pipelines: list[dict[int, Pipeline]]
    # Per shape bucket, seconds per call of each compiled size, measured here.
    costs: list[dict[int, float]]
    plans: list[dict[int, list[int]]] = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.plans is None:
            object.__setattr__(self, "plans", [{} for _ in self.pipelines])

    def plan(self, bucket: int, rows: int) -> list[int]:
        plans = self.plans[bucket]
        if rows not in plans:
            plans[rows] = batch_sizes.plan(rows, self.costs[bucket])
        return plans[rows]


class ModelRunner:
    """A compiled model, loaded on every core of this replica."""

    def __init__(self, model: CompiledModel, *, cores: int, name: str = "model",
                 observer: RuntimeObserver | None = None):
        if model.stateful:
            # Requests of different clients would share one state, and each core would need its own.
            raise ConfigError(f"model {name}: models traced with input_output_aliases (state on the core) cannot be "
                              f"served yet; call the traced model in process.")
        started = time.perf_counter()
        self.name = name
        self.observer = observer  # told of each batch's padding and each chunk; the pipelines of each stage
        self.cores = CorePool(cores)
        self.cpu_pool = ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="cpu-subgraph")
        self.span, self.copies = _copies(model, cores)
        self.cores.lead_every(self.span, self.copies)
        pipelines = [{b.batch_size: self._pipeline(b) for b in model.grid(i)} for i in range(len(model.buckets))]
        self._by_rows = False  # the costs are rows, not seconds: timing failed (see _measure)
        self._serving = _Serving(model, pipelines, self._measure(pipelines))
        self.chunks = Counter()  # (shape bucket, compiled batch size) -> chunks run
        self.load_seconds = time.perf_counter() - started
        in_place = sorted({n for grid in pipelines for p in grid.values() for n in p.in_place})
        logger.info("model %s ready on %d core(s) in %.1fs; batch sizes %s cost %s ms per call; one row runs as %s; "
                    "CPU stages run in place: %s", name, len(self.cores), self.load_seconds, sorted(self.costs[0]),
                    [round(self.costs[0][n] * 1000, 2) for n in sorted(self.costs[0])], self.plan(0, 1),
                    in_place or "none")
        if self.span > 1:
            logger.info("model %s pipelined over %d core(s) per copy; %d copies on cores %s", name, self.span,
                        self.copies, self.groups)

    def _pipeline(self, bucket: Bucket, here: bool = False) -> Pipeline:
        return Pipeline(bucket, self.cores, self.cpu_pool, self.observer, self.span, self.copies, load_here=here)

    # -- what requests run on ---------------------------------------------------------

    @property
    def model(self) -> CompiledModel:
        """The compiled model requests run on now (it grows as background compiles join)."""
        return self._serving.model

    @property
    def pipelines(self) -> list[dict[int, Pipeline]]:
        return self._serving.pipelines

    @property
    def costs(self) -> list[dict[int, float]]:
        return self._serving.costs

    def grow(self, model: CompiledModel) -> list[tuple[int, int]]:
        """Serve ``model`` from now on: the same model with more compiled models (shape buckets or
        batch sizes) than the one served. The new ones are loaded onto every core from the calling
        thread (loading compiles: call it from the thread that compiles) and timed; batches already
        running finish on what they started with. Returns the new (shape bucket, batch size) pairs,
        the bucket counted in ``model``'s buckets."""
        started = time.perf_counter()
        serving = self._serving
        known = {id(p.bucket): (p, serving.costs[i][n]) for i, grid in enumerate(serving.pipelines)
                 for n, p in grid.items()}
        pipelines = [{b.batch_size: known[id(b)][0] if id(b) in known else self._pipeline(b, here=True)
                      for b in model.grid(i)} for i in range(len(model.buckets))]
        new = [[p for p in grid.values() if id(p.bucket) not in known] for grid in pipelines]
        measured = self._measure(new, rows=self._by_rows)
        costs = [batch_sizes.monotone({n: known[id(p.bucket)][1] if id(p.bucket) in known else fresh[n]
                                       for n, p in grid.items()})
                 for grid, fresh in zip(pipelines, measured)]
        self._serving = _Serving(model, pipelines, costs)  # one assignment: a batch sees the old or the new
        added = [(i, p.bucket.batch_size) for i, grid in enumerate(new) for p in grid]
        logger.debug("model %s: %s joined in %.1fs", self.name, added, time.perf_counter() - started)
        return added

    def _measure(self, grids: list[dict[int, Pipeline] | list[Pipeline]], rows: bool = False) -> list[dict[int, float]]:
        """Per shape bucket, seconds per call of each compiled size on core 0: the fastest of
        ``TIMING_ROUNDS`` timed calls after a warm-up. A CPU stage whose warm calls take less
        than ``IN_PLACE_CPU_S`` then runs in place (:meth:`Pipeline.run_in_place`).

        Every size of every bucket takes its turn in each round, so a burst of other work
        (another replica compiling beside this one, the first metric writes) lands on one
        round of every size rather than on every call of a few; preemption only ever adds
        time, so the fastest call is the cost. With ``rows`` (timing failed before) rows
        stand in for time.
        """
        grids = [g if isinstance(g, dict) else {p.bucket.batch_size: p for p in g} for g in grids]
        if rows:
            return [{n: float(n) for n in grid} for grid in grids]
        core = self.cores.cores[0]
        pipelines = [p for grid in grids for p in grid.values()]
        examples = {id(p): [torch.zeros(shape, dtype=dtype) if shape is not None else None
                            for shape, dtype in p.bucket.input_shapes] for p in pipelines}
        fastest = {id(p): float("inf") for p in pipelines}
        try:
            for round_ in range(1 + TIMING_ROUNDS):
                for pipeline in pipelines:
                    started = time.perf_counter()
                    pipeline.run_blocking(examples[id(pipeline)], core)
                    if round_:  # round 0 warms every size up
                        fastest[id(pipeline)] = min(fastest[id(pipeline)], time.perf_counter() - started)
            for pipeline in pipelines:
                times: dict[str, float] = {}
                pipeline.run_blocking(examples[id(pipeline)], core, times)
                pipeline.run_in_place({name for name in pipeline.cpu_modules
                                       if times.get(name, math.inf) < IN_PLACE_CPU_S})
        except Exception as exc:  # a CPU op may refuse all-zero inputs; then rows stand in for time
            logger.warning("model %s: cannot time batch size %d on zeros (%s: %s); choosing sizes by rows",
                           self.name, pipeline.bucket.batch_size, type(exc).__name__, exc)
            self._by_rows = True
            return [{n: float(n) for n in grid} for grid in grids]
        return [batch_sizes.monotone({n: fastest[id(p)] for n, p in grid.items()}) for grid in grids]

    def use_costs(self, costs: list[dict[int, float]]) -> None:
        """Choose sizes by ``costs`` (per shape bucket, seconds per call of each size) instead of those measured."""
        serving = self._serving
        if len(costs) != len(serving.pipelines) or any(set(c) != set(g) for c, g in zip(costs, serving.pipelines)):
            raise ValueError(f"use_costs: give a cost for every compiled size of every bucket: "
                             f"{[sorted(g) for g in serving.pipelines]}")
        self._serving = _Serving(serving.model, serving.pipelines, [dict(c) for c in costs])

    def plan(self, bucket: int, rows: int) -> list[int]:
        """The compiled sizes (largest first) that run ``rows`` rows of shape bucket ``bucket``."""
        return self._serving.plan(bucket, rows)

    @property
    def partitions(self) -> list[dict]:
        return [p.describe() for p in self.model.first.partitions]

    async def infer(self, requests: list[list[torch.Tensor]], inline: bool = False
                    ) -> list[list[torch.Tensor] | Exception]:
        """Run a batch of requests (each a list of input tensors); one result per request.

        A request that cannot run (too large for every bucket) gets its exception as
        its result; the others still run. ``inline``: the caller found the batch's request
        alone (``lone.LoneRequests.alone``), so nothing else is waiting for its thread; the
        batch then runs on that thread, blocking it, when ``lone.runs_inline`` allows.
        """
        serving = self._serving  # the whole batch runs on what is served as it starts
        model = serving.model
        results: list[list[torch.Tensor] | Exception] = [None] * len(requests)  # type: ignore[list-item]
        groups: dict[int, list[int]] = defaultdict(list)
        placed: dict[int, list[torch.Tensor]] = {}
        for i, inputs in enumerate(requests):
            try:
                bucket, placed[i] = model.place(inputs)
            except NeuronServeError as exc:
                results[i] = exc
                continue
            groups[bucket].append(i)
        if self.observer is not None and model.spec is not None and len(model.spec.sizes[0]) == 1:
            # One bucketed dim (the usual: a sequence length): each request's size against its bucket's, for the
            # model's padding counts (buckets/usage.py). Several dims have no one size to propose buckets from.
            for bucket, members in groups.items():
                for i in members:
                    self.observer.shape(model.spec.request_sizes(requests[i])[0], model.spec.sizes[bucket][0])
        if self.observer is not None or inline:
            rows = {b: sum(placed[i][0].shape[0] for i in members) for b, members in groups.items()}
            plans = {b: serving.plan(b, n) for b, n in rows.items()}
            if self.observer is not None:
                self.observer.padding(sum(sum(plans[b]) - n for b, n in rows.items()))
            if inline:
                inline = lone.runs_inline([serving.costs[b][size] for b, plan in plans.items() for size in plan],
                                          self.span, self.cores.busy())
        runs = [self._run_group(serving, b, members, requests, placed, results, inline)
                for b, members in groups.items()]
        # One group (the usual case) is awaited directly: gather would wrap it in a task, one
        # more turn of the event loop on every batch.
        if len(runs) == 1:
            await runs[0]
        elif runs:
            await asyncio.gather(*runs)
        return results

    async def _run_group(self, serving: _Serving, bucket, members, requests, placed, results,
                         inline: bool = False) -> None:
        model = serving.model
        if len(members) == 1:  # a lone request: its rows are the batch, its outputs the answer
            [i] = members
            try:
                results[i] = model.unpad(await self._run_rows(serving, bucket, placed[i], inline), requests[i])
            except Exception as exc:
                results[i] = exc
            return
        batch, sizes = request_rows.collate([placed[i] for i in members])
        try:
            outputs = await self._run_rows(serving, bucket, batch, inline)
        except Exception as exc:
            # One request's rows can make a subgraph raise (a CPU op refusing a value);
            # re-running each request alone confines the failure to the request that
            # caused it, so its batch-mates still get their results.
            logger.warning("batch of %d requests failed (%s: %s); re-running each alone",
                           len(members), type(exc).__name__, exc)
            await asyncio.gather(*(self._run_group(serving, bucket, [i], requests, placed, results)
                                   for i in members))
            return
        for i, out in zip(members, request_rows.split(outputs, sizes)):
            results[i] = model.unpad(out, requests[i])

    async def _run_rows(self, serving: _Serving, bucket: int, batch: list[torch.Tensor],
                        inline: bool = False) -> list[torch.Tensor]:
        rows = batch[0].shape[0]
        chunks = batch_sizes.split(batch, rows, serving.plan(bucket, rows))
        pipelines = serving.pipelines[bucket]
        if len(chunks) == 1 and not chunks[0][2]:  # one unpadded chunk: its outputs are the rows'
            return await self._run_chunk(pipelines, bucket, *chunks[0], inline=inline)
        if len(chunks) == 1:
            outputs = [await self._run_chunk(pipelines, bucket, *chunks[0], inline=inline)]
        else:
            outputs = await asyncio.gather(*(self._run_chunk(pipelines, bucket, *chunk) for chunk in chunks))
        return dynamic_batch.join_chunks(list(outputs), rows)

    async def _run_chunk(self, pipelines: dict[int, Pipeline], bucket: int, size: int, flat: list[torch.Tensor],
                         padded: int, inline: bool = False) -> list[torch.Tensor]:
        core = self.cores.next()
        try:
            self.chunks[bucket, size] += 1
            if self.observer is not None:
                self.observer.chunk(core.index, size, padded)
            return await pipelines[size].run(flat, core, inline)
        finally:
            self.cores.release(core)

    @property
    def groups(self) -> list[list[int]]:
        """The cores of each copy of the model (one core each when replicated)."""
        return [list(range(lead, lead + self.span)) for lead in range(0, self.copies * self.span, self.span)]

    def stage_memory(self) -> list[tuple[int, int, str, int, int]]:
        """(shape bucket, batch size, stage, core, bytes) for every pipeline stage on every core it is loaded on."""
        return [(bucket, size, p.name, lead + p.core, p.memory_bytes)
                for bucket, grid in enumerate(self.pipelines) for size, pipeline in grid.items()
                for p in pipeline.bucket.partitions if p.is_stage for lead in range(0, self.copies * self.span, self.span)]

    def held_weights(self) -> list:
        """The weights the loaded models' executables take, as held on each core (compile/core_weights.py): one
        tensor a core, whatever the number of compiled models; none for weights compiled in."""
        held = {}
        for grid in self.pipelines:
            for pipeline in grid.values():
                for modules in pipeline.modules:
                    for module in modules.values():
                        for weight in (getattr(module, "held_weights", None) or {}).values():
                            held[id(weight)] = weight
        return list(held.values())

    def close(self) -> None:
        self.cpu_pool.shutdown(wait=False)
        self.cores.shutdown()
