"""ModelRunner: builds a model.yaml's model in this process and runs request batches.

Building runs the whole compile pipeline (capture, analyze, partition, compile per
bucket) and loads every accelerator subgraph onto every core. A batch of requests is
padded into its bucket, concatenated, split into trace-size chunks, and the chunks
are spread round-robin over the cores, each chunk a pipeline of core and CPU stages.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .. import batching
from ..bucketing import BucketSpec
from ..build import build, trace_batch
from ..config import DTYPES, ModelConfig
from ..errors import NeuronServeError
from ..traced import TracedModule
from . import collate
from .cores import CorePool
from .pipeline import Pipeline, StageTimer

logger = logging.getLogger("neuron_serve")


class ModelRunner:
    """The compiled model of one deployment, on every core of this replica."""

    def __init__(self, config: ModelConfig, base_dir: str | Path | None = None, on_stage: StageTimer | None = None):
        started = time.perf_counter()
        self.config = config
        built = build(config, base_dir)
        self.spec: BucketSpec | None = built.spec
        self.buckets: list[TracedModule] = built.buckets
        self.output_names = built.output_names
        self.trace_batch = trace_batch(config)
        self.cores = CorePool(config.cores_per_replica)
        self.cpu_pool = ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="cpu-subgraph")
        self.pipelines = [Pipeline(traced, self.cores, self.cpu_pool, on_stage) for traced in self.buckets]
        self.build_seconds = time.perf_counter() - started
        logger.info("model %s ready on %d core(s) in %.1fs", config.name, len(self.cores), self.build_seconds)

    @property
    def partitions(self) -> list[dict]:
        return [p.describe() for p in self.buckets[0].partitions]

    def input_dtypes(self) -> list[torch.dtype]:
        return [DTYPES[i.dtype] for i in self.config.inputs]

    async def infer(self, requests: list[list[torch.Tensor]]) -> list[list[torch.Tensor] | Exception]:
        """Run a batch of requests (each a list of input tensors); one result per request.

        A request that cannot run (too large for every bucket) gets its exception as
        its result; the others still run.
        """
        results: list[list[torch.Tensor] | Exception] = [None] * len(requests)  # type: ignore[list-item]
        groups: dict[int, list[int]] = defaultdict(list)
        padded: dict[int, list[torch.Tensor]] = {}
        for i, inputs in enumerate(requests):
            try:
                bucket, padded[i] = self._place(inputs)
            except NeuronServeError as exc:
                results[i] = exc
                continue
            groups[bucket].append(i)
        await asyncio.gather(*(self._run_group(b, members, requests, padded, results) for b, members in groups.items()))
        return results

    def _place(self, inputs: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        if self.spec is None:
            return 0, list(inputs)
        padded, index = self.spec.kernel(list(inputs))
        return int(index), padded

    async def _run_group(self, bucket, members, requests, padded, results) -> None:
        batch, sizes = collate.collate([padded[i] for i in members])
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
            await asyncio.gather(*(self._run_group(bucket, [i], requests, padded, results) for i in members))
            return
        for i, out in zip(members, collate.split(outputs, sizes)):
            if self.spec is not None:
                out = self.spec.unpad(out, self.spec.request_sizes(requests[i]))
            results[i] = out

    async def _run_rows(self, bucket: int, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        pipeline = self.pipelines[bucket]
        rows = batch[0].shape[0]
        chunks = batching.split_chunks(batch, rows, self.trace_batch)
        outputs = await asyncio.gather(*(pipeline.run(chunk, self.cores.next()) for chunk in chunks))
        return batching.join_chunks(list(outputs), rows)

    def close(self) -> None:
        self.cpu_pool.shutdown(wait=False)
        self.cores.shutdown()
