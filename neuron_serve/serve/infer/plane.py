"""The protocol-agnostic data plane of one model: metadata, readiness and inference.

It takes a decoded `InferRequest` and answers an `InferResponse` (tensors in, tensors
out); each protocol is a codec at the edge (``serve/protocols``) whose decode and
encode `handle` runs around the inference, so that every protocol is timed and
counted alike. HTTP routes and the gRPC service are thin adapters over this class (as
KServe's DataPlane), so it is tested with a local model and served by Ray alike.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any, Callable, Mapping, TypeVar

import torch

from ... import metrics
from ...version import __version__
from ...config import ModelConfig
from ...errors import InvalidInput, NeuronServeError
from ...model import CompiledModel
from ...runtime.request_queue import DynamicBatcher
from ...runtime.runner import ModelRunner
from ...targets.pjrt import emulated
from ..protocols import oip_rest
from ..protocols.infer import TORCH_TO_DATATYPE, InferRequest, InferResponse, TensorSpec, check_inputs, select_outputs
from . import triton as triton_ext
from .neuron_monitor import CoreMonitor

logger = logging.getLogger("neuron_serve")

Encoded = TypeVar("Encoded")
# A replica that has had no two requests in flight at once for this long serves one at a
# time (concurrency 1): its lone requests run on the event loop's thread (ModelRunner.infer).
ALONE_QUIET_S = 0.05
# Turns of the event loop a lone request gives before it takes the loop's thread, so that
# requests which reached the replica meanwhile come in and are counted (each turn ~5 µs).
ALONE_YIELDS = 3


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


class ModelDataPlane:
    """One built model on one replica: loads it on the cores, batches its requests, speaks OIP v2."""

    def __init__(self, config: ModelConfig, model: CompiledModel, replica: str | None = None) -> None:
        self.config = config
        self.name = config.name
        self.replica = replica or str(os.getpid())
        labels = {"model": self.name, "replica": self.replica}
        self._labels = labels
        # Labelled once: labels() costs microseconds, and these are recorded per request.
        self._queue_time = metrics.QUEUE_TIME.labels(**self._labels)
        self._latency = metrics.REQUEST_LATENCY.labels(**self._labels)
        self._children: dict[tuple, Any] = {}
        self.deferred = DeferredMetrics()
        self.runner = ModelRunner(model, cores=config.cores_per_replica, name=self.name, on_stage=self._on_stage,
                                  on_chunk=self._on_chunk, on_padding=self._on_padding, on_transfer=self._on_transfer)
        metrics.COMPILE_TIME.labels(**labels).observe(model.build_info.seconds + self.runner.load_seconds)
        for bucket, costs in enumerate(self.runner.costs):
            for size, seconds in costs.items():
                metrics.SIZE_COST.labels(**labels, bucket=str(bucket), batch_size=str(size)).set(seconds)
        for bucket, size, stage, core, size_bytes in self.runner.stage_memory():
            metrics.STAGE_MEMORY.labels(**labels, bucket=str(bucket), batch_size=str(size), partition=stage,
                                        core=str(core)).set(size_bytes)
        metrics.BUILD_COMPILES.labels(**labels).inc(model.build_info.compiles)
        for kind, hits in model.build_info.cache_hits.items():
            metrics.CACHE_HITS.labels(**labels, cache=kind).inc(hits)
        signature = model.signature()
        self.inputs = [TensorSpec(s.name, TORCH_TO_DATATYPE[s.dtype], s.shape) for s in signature.inputs]
        self.outputs = [{"name": s.name, "datatype": TORCH_TO_DATATYPE.get(s.dtype, "FP32"), "shape": list(s.shape)}
                        for s in signature.outputs]
        batching = config.batching
        self.batcher = DynamicBatcher(
            self._run_batch,
            max_batch_size=batching.max_batch_size,
            max_queue_delay_s=batching.max_queue_delay_ms / 1000,
            max_queue_size=batching.max_queue_size,
            request_timeout_s=batching.request_timeout_s,
            preferred_batch_sizes=model.batch_sizes if model.dynamic_batch_enabled else None,
            max_concurrent_batches=2 * len(self.runner.cores),
            on_batch=self._on_batch,
        )
        # The most elements one input of a valid request can hold; larger ones are refused
        # before anything is allocated.
        self.max_elements = batching.max_batch_size * model.max_row_elements()
        self._ready = False
        self._in_flight = 0  # requests between decode and answer
        self._overlapped = -ALONE_QUIET_S  # when two requests were last in flight at once

    # -- hooks for metrics ----------------------------------------------------------

    def _child(self, metric: Any, **labels: str) -> Any:
        """``metric``'s child for this model and replica and ``labels``, looked up once.

        The hooks below run for every chunk and stage; ``labels()`` costs microseconds each.
        """
        key = (metric, *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels, **labels)
        return child

    # Each hook queues its update (DeferredMetrics); ``_record_*`` apply them later.

    def _on_stage(self, partition: str, device: str, core: int, seconds: float) -> None:
        self.deferred.add(self._record_stage, partition, device, core, seconds)  # on the core's thread

    def _record_stage(self, partition: str, device: str, core: int, seconds: float) -> None:
        self._child(metrics.PARTITION_TIME, partition=partition, device=device, core=str(core)).observe(seconds)

    def _on_transfer(self, stage: str, core: int, size_bytes: int) -> None:
        self.deferred.add(self._record_transfer, stage, core, size_bytes)

    def _record_transfer(self, stage: str, core: int, size_bytes: int) -> None:
        self._child(metrics.STAGE_INPUT_BYTES, partition=stage, core=str(core)).inc(size_bytes)

    def _on_chunk(self, core: int, batch_size: int, padded: int) -> None:
        self.deferred.add(self._record_chunk, core, batch_size, padded)

    def _record_chunk(self, core: int, batch_size: int, padded: int) -> None:
        # One per chunk, however many accelerator partitions the chunk runs through.
        self._child(metrics.CORE_BATCHES, core=str(core)).inc()
        self._child(metrics.SIZE_CHUNKS, batch_size=str(batch_size)).inc()
        self._child(metrics.PADDING_ROWS).inc(padded)

    def _on_padding(self, padded: int) -> None:
        self.deferred.add(self._child(metrics.BATCH_PADDING).observe, padded)

    def _on_batch(self, rows: int, waits: list[float]) -> None:
        self.deferred.add(self._record_batch, rows, waits)

    def _record_batch(self, rows: int, waits: list[float]) -> None:
        self._child(metrics.BATCH_SIZE).observe(rows)
        for wait in waits:
            self._queue_time.observe(wait)

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self.batcher.start()
        self.monitor = CoreMonitor(self.runner.cores.cores, self.name, self.replica, emulated())
        self.monitor.start()
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        await self.batcher.stop(drain=True)
        self.deferred.flush()
        if getattr(self, "monitor", None) is not None:
            self.monitor.stop()
        self.runner.close()

    def ready(self) -> bool:
        return self._ready

    # -- protocol -------------------------------------------------------------------

    def metadata(self) -> dict:
        return {
            "name": self.name,
            "versions": ["1"],
            "platform": f"neuron-serve/{self.config.target}" + ("-emulated" if emulated() else ""),
            "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in self.inputs],
            "outputs": self.outputs,
            "parameters": {
                "emulated": emulated(),
                "cores": len(self.runner.cores),
                "partitions": self.runner.partitions,
                "batch_sizes": self.runner.model.batch_sizes,
                "neuron_serve_version": __version__,
            },
        }

    def _alone(self) -> bool:
        return self._in_flight == 1 and time.perf_counter() - self._overlapped > ALONE_QUIET_S

    async def _serving_alone(self) -> bool:
        """Whether the one request in flight may take the event loop's thread to run.

        Only at concurrency 1: nothing else in flight, and nothing overlapped for
        ``ALONE_QUIET_S``. Requests that arrived while the loop was busy (running the
        previous lone request, say) get their turns first; if one comes in, this request
        is handed to a core as usual, and later ones are for ``ALONE_QUIET_S``, so a
        burst is batched rather than run one by one on the loop.
        """
        if not self._alone():
            return False
        for _ in range(ALONE_YIELDS):
            await asyncio.sleep(0)
        return self._alone()

    async def _run_batch(self, items: list[tuple[list[torch.Tensor], triton_ext.RequestTimes]]) -> list:
        inline = len(items) == 1 and await self._serving_alone()
        started = time.perf_counter()
        results = await self.runner.infer([tensors for tensors, _ in items], inline=inline)
        ran = time.perf_counter()
        for _, times in items:
            times.started, times.ran = started, ran
        if any(not isinstance(r, Exception) for r in results):
            self.deferred.add(self._child(metrics.EXECUTIONS).inc)
        return results

    def triton_config(self) -> dict:
        """This model's configuration in Triton's ModelConfig JSON."""
        return triton_ext.model_config(self.config, self.metadata()["inputs"], self.outputs,
                                       self.runner.model.batch_sizes,
                                       emulated())

    async def infer(self, body: bytes, headers: Mapping[str, str]) -> tuple[bytes, dict[str, str]]:
        """Decode, batch, run and encode one OIP v2 REST infer request (JSON or binary)."""
        return await self.handle(
            lambda: oip_rest.parse_infer_request(body, headers, max_elements=self.max_elements, model=self.name),
            oip_rest.encode_response,
        )

    async def handle(self, decode: Callable[[], InferRequest],
                     encode: Callable[[InferResponse], Encoded]) -> Encoded:
        """One request of any protocol: ``decode`` it, run it, ``encode`` the answer.

        The codec's own work is timed with the request (Triton's compute_input and
        compute_output), and the request is counted by status whichever step fails.
        """
        started = time.perf_counter()
        times = triton_ext.RequestTimes(received=started)
        code, rows = "500", 0
        self._in_flight += 1
        if self._in_flight > 1:
            self._overlapped = started
        try:
            request = decode()
            times.decoded = time.perf_counter()
            response, rows = await self._run(request, times)
            encoded = encode(response)
            code = "200"
            times.answered = time.perf_counter()
            return encoded
        except NeuronServeError as exc:
            code = str(exc.http_status)
            raise
        finally:
            self._in_flight -= 1
            ended = time.perf_counter()
            times.answered = times.answered or ended
            self.deferred.add(self._record_request, times, code, rows, ended - started)
            self.deferred.flush_soon()

    def _record_request(self, times: triton_ext.RequestTimes, code: str, rows: int, seconds: float) -> None:
        triton_ext.record(self.name, self.replica, times, code == "200", rows)
        self._child(metrics.REQUESTS, code=code).inc()
        self._latency.observe(seconds)

    async def _run(self, request: InferRequest, times: triton_ext.RequestTimes) -> tuple[InferResponse, int]:
        """Check a decoded request against the model, batch and run it; (answer, rows)."""
        tensors = check_inputs(request.inputs, self.inputs)
        rows = tensors[0].shape[0] if tensors[0].dim() else 1
        if rows > self.config.batching.max_batch_size:
            raise InvalidInput(
                f"the request has {rows} rows; this model accepts at most "
                f"{self.config.batching.max_batch_size} (batching.max_batch_size)."
            )
        outputs = await self.batcher.submit((tensors, times), rows=rows)
        named = list(zip(self.runner.model.output_names, outputs))
        selected = select_outputs(request, named, self.name)
        return InferResponse(self.name, "1", request.id, selected), rows


_current: ModelDataPlane | None = None


def current() -> ModelDataPlane | None:
    """The data plane of this process's replica (a Serve replica holds one model)."""
    return _current


def set_current(plane: ModelDataPlane | None) -> None:
    global _current
    _current = plane
