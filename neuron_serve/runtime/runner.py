"""ModelRunner: a built model on the cores of this replica, running request batches.

The runner takes a :class:`~neuron_serve.model.CompiledModel` built elsewhere (by the
serving edge) and learns everything from it: which bucket a request goes to (the
model's kernel), how many rows one compiled call takes (the bucket's batch size), and
how outputs are cut back. Requests of one bucket are concatenated along dim 0, split
into chunks of that batch size (the last padded) and spread round-robin over the
cores, each chunk a pipeline of core and CPU stages.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import batching
from ..errors import NeuronServeError
from ..model import CompiledModel
from . import collate
from .cores import CorePool
from .pipeline import Pipeline, StageTimer

logger = logging.getLogger("neuron_serve")


class ModelRunner:
    """A compiled model, loaded on every core of this replica."""

    def __init__(self, model: CompiledModel, *, cores: int, name: str = "model", on_stage: StageTimer | None = None):
        started = time.perf_counter()
        self.model = model
        self.name = name
        self.cores = CorePool(cores)
        self.cpu_pool = ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="cpu-subgraph")
        self.pipelines = [Pipeline(bucket, self.cores, self.cpu_pool, on_stage) for bucket in model.buckets]
        self.load_seconds = time.perf_counter() - started
        logger.info("model %s ready on %d core(s) in %.1fs", name, len(self.cores), self.load_seconds)

    @property
    def partitions(self) -> list[dict]:
        return [p.describe() for p in self.model.first.partitions]

    async def infer(self, requests: list[list[torch.Tensor]]) -> list[list[torch.Tensor] | Exception]:
        """Run a batch of requests (each a list of input tensors); one result per request.

        A request that cannot run (too large for every bucket) gets its exception as
        its result; the others still run.
        """
        results: list[list[torch.Tensor] | Exception] = [None] * len(requests)  # type: ignore[list-item]
        groups: dict[int, list[int]] = defaultdict(list)
        placed: dict[int, list[torch.Tensor]] = {}
        for i, inputs in enumerate(requests):
            try:
                bucket, placed[i] = self.model.place(inputs)
            except NeuronServeError as exc:
                results[i] = exc
                continue
            groups[bucket].append(i)
        await asyncio.gather(*(self._run_group(b, members, requests, placed, results) for b, members in groups.items()))
        return results

    async def _run_group(self, bucket, members, requests, placed, results) -> None:
        batch, sizes = collate.collate([placed[i] for i in members])
        try:
            outputs = await self._run_rows(bucket, batch)
        except Exception as exc:
            if len(members) == 1:
                results[members[0]] = exc
                return
            # One request's rows can make a subgraph raise (a CPU op refusing a value);
            # re-running each request alone confines the failure to the request that
            # caused it, so its batch-mates still get their results.
            logger.warning("batch of %d requests failed (%s: %s); re-running each alone",
                           len(members), type(exc).__name__, exc)
            await asyncio.gather(*(self._run_group(bucket, [i], requests, placed, results) for i in members))
            return
        for i, out in zip(members, collate.split(outputs, sizes)):
            results[i] = self.model.unpad(out, requests[i])

    async def _run_rows(self, bucket: int, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        pipeline = self.pipelines[bucket]
        rows = batch[0].shape[0]
        chunks = batching.split_chunks(batch, rows, self.model.buckets[bucket].batch_size)
        outputs = await asyncio.gather(*(pipeline.run(chunk, self.cores.next()) for chunk in chunks))
        return batching.join_chunks(list(outputs), rows)

    def close(self) -> None:
        self.cpu_pool.shutdown(wait=False)
        self.cores.shutdown()
