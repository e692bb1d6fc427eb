"""A replica's metrics (``neuron_serve.metrics``): the runtime's events and the data plane's.

`ReplicaMetrics` is the `RuntimeObserver` the data plane hands its request queue and
runner, and it records what the plane itself sees (a model loaded, a batch executed, a
request answered). Every update is queued (`DeferredMetrics`) and applied once the answer
is out.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Callable

from ... import metrics
from ...assembly.queue import COMPILED, CompileJob
from ...model import CompiledModel
from ...runtime.observer import RuntimeObserver
from ...runtime.runner import ModelRunner
from . import triton as triton_ext

logger = logging.getLogger("neuron_serve")


class DeferredMetrics:
    """Metric updates queued while a request runs and applied once its answer is out.

    A request makes about twenty updates (Triton's statistics, latency, batch, chunk and
    stage metrics), each a lock and an mmap write in Prometheus' multiprocess mode. Applied
    on the event loop's next turn, after the handler has written the answer, they cost a
    request no latency. Any thread may queue (``deque.append`` is atomic); the event loop
    applies them, in order.
    """

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Callable[..., None], tuple]] = collections.deque()
        self._scheduled = False

    def add(self, record: Callable[..., None], *args: Any) -> None:
        self._queue.append((record, args))

    def flush_soon(self) -> None:
        """Apply what is queued on the running loop's next turn (once, however often asked)."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        while self._queue:
            record, args = self._queue.popleft()
            try:
                record(*args)
            except Exception:  # a metric must never fail serving
                logger.exception("recording a metric failed")


class ReplicaMetrics(RuntimeObserver):
    """One model's metrics on one replica. Each event queues its update (``deferred``); ``_record_*`` apply them."""

    def __init__(self, model: str, replica: str, usage: Any = None) -> None:
        self.model = model
        self.replica = replica
        # The sizes asked for and what the buckets padded of them (buckets/usage.Usage), when the model keeps them.
        self.usage = usage
        self._labels = {"model": model, "replica": replica}
        # Labelled once: labels() costs microseconds, and these are recorded per request.
        self._queue_time = metrics.QUEUE_TIME.labels(**self._labels)
        self._latency = metrics.REQUEST_LATENCY.labels(**self._labels)
        self._children: dict[tuple, Any] = {}
        self.deferred = DeferredMetrics()
        self._loaded = False
        self._counted: dict[str, int] = {"compiles": 0}  # build compiles and cache hits recorded so far

    def _child(self, metric: Any, **labels: str) -> Any:
        """``metric``'s child for this model and replica and ``labels``, looked up once.

        The events below come for every chunk and stage; ``labels()`` costs microseconds each.
        """
        key = (metric, *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels, **labels)
        return child

    # -- the data plane's events ------------------------------------------------------

    def loaded(self, model: CompiledModel, runner: ModelRunner) -> None:
        """The model is built and on the cores, or grew (compiled models joined it): its build
        and load (once), its costs and memory, and the compiles and cache hits since the last time."""
        labels = self._labels
        if not self._loaded:
            metrics.COMPILE_TIME.labels(**labels).observe(model.build_info.seconds + runner.load_seconds)
        self._loaded = True
        for bucket, costs in enumerate(runner.costs):
            for size, seconds in costs.items():
                metrics.SIZE_COST.labels(**labels, bucket=str(bucket), batch_size=str(size)).set(seconds)
        for bucket, size, stage, core, size_bytes in runner.stage_memory():
            metrics.STAGE_MEMORY.labels(**labels, bucket=str(bucket), batch_size=str(size), partition=stage,
                                        core=str(core)).set(size_bytes)
        metrics.BUILD_COMPILES.labels(**labels).inc(model.build_info.compiles - self._counted["compiles"])
        self._counted["compiles"] = model.build_info.compiles
        for kind, hits in model.build_info.cache_hits.items():
            metrics.CACHE_HITS.labels(**labels, cache=kind).inc(hits - self._counted.get(kind, 0))
            self._counted[kind] = hits

    def compile_job(self, job: CompileJob) -> None:
        """A job of the model's compile queue started or ended: a compiled model's seconds."""
        if job.kind == "compile" and job.state == COMPILED and job.seconds is not None:
            bucket = job.label.removeprefix(f"{self.model} ") if job.label != self.model else self.model
            metrics.COMPILE_SECONDS.labels(**self._labels, bucket=bucket).set(job.seconds)

    def compile_counts(self, state: dict) -> None:
        """The model's compiled models by state (``ModelDataPlane.compile_state``)."""
        for name in ("compiled", "pending", "failed"):
            metrics.COMPILED_MODELS.labels(**self._labels, state=name).set(state.get(name, 0))

    def host_memory(self, report: dict) -> None:
        """What the replica holds of host memory (assembly/host_memory.report), as neuron_serve_host_memory_bytes."""
        metrics.set_host_memory(self.model, self.replica, report)

    def executed(self) -> None:
        """A batch ran with at least one request answered (Triton's execution count)."""
        self.deferred.add(self._child(metrics.EXECUTIONS).inc)

    def answered(self, times: triton_ext.RequestTimes, code: str, rows: int, seconds: float) -> None:
        """A request is answered (``code`` "200") or failed; applied on the loop's next turn."""
        self.deferred.add(self._record_request, times, code, rows, seconds)
        self.deferred.flush_soon()

    def _record_request(self, times: triton_ext.RequestTimes, code: str, rows: int, seconds: float) -> None:
        triton_ext.record(self.model, self.replica, times, code == "200", rows)
        self._child(metrics.REQUESTS, code=code).inc()
        self._latency.observe(seconds)

    # -- RuntimeObserver ---------------------------------------------------------------

    def stage(self, partition: str, device: str, core: int, seconds: float) -> None:
        self.deferred.add(self._record_stage, partition, device, core, seconds)  # on the core's thread

    def _record_stage(self, partition: str, device: str, core: int, seconds: float) -> None:
        self._child(metrics.PARTITION_TIME, partition=partition, device=device, core=str(core)).observe(seconds)

    def transfer(self, stage: str, core: int, size_bytes: int) -> None:
        self.deferred.add(self._record_transfer, stage, core, size_bytes)

    def _record_transfer(self, stage: str, core: int, size_bytes: int) -> None:
        self._child(metrics.STAGE_INPUT_BYTES, partition=stage, core=str(core)).inc(size_bytes)

    def chunk(self, core: int, batch_size: int, padded: int) -> None:
        self.deferred.add(self._record_chunk, core, batch_size, padded)

    def _record_chunk(self, core: int, batch_size: int, padded: int) -> None:
        # One per chunk, however many accelerator partitions the chunk runs through.
        self._child(metrics.CORE_BATCHES, core=str(core)).inc()
        self._child(metrics.SIZE_CHUNKS, batch_size=str(batch_size)).inc()
        self._child(metrics.PADDING_ROWS).inc(padded)
        if self.usage is not None:
            self._count_work(self.usage.record("rows", batch_size - padded, batch_size), batch_size - padded, padded)

    def shape(self, size: int, bucket: int) -> None:
        if self.usage is not None:
            self.deferred.add(self._record_shape, size, bucket)

    def _record_shape(self, size: int, bucket: int) -> None:
        self._count_work(self.usage.record("shape", size, bucket), size, bucket - size)

    @staticmethod
    def _count_work(counters: tuple, real: int, padded: int) -> None:
        real_counter, padded_counter = counters
        real_counter.inc(real)
        padded_counter.inc(padded)

    def padding(self, padded: int) -> None:
        self.deferred.add(self._child(metrics.BATCH_PADDING).observe, padded)

    def batch(self, rows: int, waits: list[float]) -> None:
        self.deferred.add(self._record_batch, rows, waits)

    def _record_batch(self, rows: int, waits: list[float]) -> None:
        self._child(metrics.BATCH_SIZE).observe(rows)
        for wait in waits:
            self._queue_time.observe(wait)
