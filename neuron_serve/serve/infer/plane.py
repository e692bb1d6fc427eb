"""The protocol-agnostic data plane of one model: metadata, readiness and inference.

It takes a decoded `InferRequest` and answers an `InferResponse` (tensors in, tensors
out), and knows no protocol. Each protocol's route decodes the request with its codec
(``serve/protocols``), calls `ModelDataPlane.infer`, and encodes the answer, all inside
the request's `InferCall` (`ModelDataPlane.begin`), so that every protocol is timed and
counted alike, its codec's work included:

    plane.admit()                      # refuse before reading a body when the queue is full
    with plane.begin() as call:
        request = codec.decode(...)    # an InferRequest
        return codec.encode(await plane.infer(request, call))

HTTP routes (``http.py``) and the gRPC service (``serve/grpc/service.py``) are thin
adapters over this class (as KServe's DataPlane), so it is tested with a local model and
served by Ray alike.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ...buckets import usage as bucket_usage
from ...assembly import host_memory
from ...assembly.queue import CompileGroup, CompileJob
from ...version import __version__
from ...config.schema import ModelConfig
from ...errors import InvalidInput, NeuronServeError
from ...model import CompiledModel
from ...runtime.lone import LoneRequests
from ...runtime.request_queue import DynamicBatcher
from ...runtime.runner import ModelRunner
from ...targets.pjrt import emulated
from ..protocols.infer import TORCH_TO_DATATYPE, InferRequest, InferResponse, TensorSpec, check_inputs, select_outputs
from . import triton as triton_ext
from .neuron_monitor import CoreMonitor
from .observer import ReplicaMetrics

logger = logging.getLogger("neuron_serve")


class InferCall:
    """One infer request on a data plane, from before its decode to after its encode.

    A context manager (`ModelDataPlane.begin`): entering starts the request's clock
    (Triton's statistics) and counts it in flight (`LoneRequests`); leaving records it
    (after the answer is out), by status: 200, the HTTP status of a `NeuronServeError`
    raised inside (a decode refused is 400, a full queue 503), else 500.
    """

    __slots__ = ("plane", "times", "rows", "_started")

    def __init__(self, plane: ModelDataPlane) -> None:
        self.plane = plane
        self.rows = 0  # the request's rows, once answered

    def __enter__(self) -> InferCall:
        self._started = started = time.perf_counter()
        self.times = triton_ext.RequestTimes(received=started)
        self.plane.lone.arrived(started)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, traceback: object) -> None:
        plane = self.plane
        plane.lone.left()
        ended = time.perf_counter()
        times = self.times
        times.answered = ended
        code = "200" if kind is None else str(exc.http_status) if isinstance(exc, NeuronServeError) else "500"
        plane.observer.answered(times, code, self.rows, ended - self._started)


class ModelDataPlane:
    """One built model on one replica: loads it on the cores, batches its requests, speaks OIP v2."""

    def __init__(self, config: ModelConfig, model: CompiledModel, replica: str | None = None,
                 parameters: dict | None = None, *, compiles: CompileGroup | None = None,
                 record_sizes: bool = False) -> None:
        self.config = config
        self.parameters = dict(parameters or {})  # more of metadata's parameters (a pooling model's settings)
        self.name = config.name
        self.replica = replica or str(os.getpid())
        # record_sizes (a task: infer model): each request's size along its bucketed dim and each chunk's rows,
        # against the buckets and batch sizes that ran them: counted, in the metadata, kept in the compile cache
        # for `neuron-serve buckets` (a pooling model records its token lengths itself).
        self.usage = bucket_usage.for_model(self.name, self.replica) if record_sizes else None
        # The runtime's events, and the plane's, as this replica's metrics: one observer, handed down once.
        self.observer = ReplicaMetrics(self.name, self.replica, self.usage)
        self.runner = ModelRunner(model, cores=config.cores_per_replica, name=self.name, observer=self.observer)
        self.observer.loaded(model, self.runner)
        # The model's compiles on this replica's compile queue (those still running join through grow).
        self.compiles = compiles
        self._unsubscribe = None
        if compiles is not None:
            self._unsubscribe = compiles.subscribe(self._compile_event)
            for job in compiles.jobs():
                self.observer.compile_job(job)
        signature = model.signature()
        self.inputs = [TensorSpec(s.name, TORCH_TO_DATATYPE[s.dtype], s.shape) for s in signature.inputs]
        self.outputs = _outputs(model)
        self.observer.compile_counts(self.compile_state())
        batching = config.batching
        self._batcher = DynamicBatcher(
            self._run_batch,
            max_batch_size=batching.max_batch_size,
            max_queue_delay_s=batching.max_queue_delay_ms / 1000,
            max_queue_size=batching.max_queue_size,
            request_timeout_s=batching.request_timeout_s,
            preferred_batch_sizes=model.batch_sizes if model.dynamic_batch_enabled else None,
            max_concurrent_batches=2 * len(self.runner.cores),
            observer=self.observer,
        )
        # The most elements one input of a valid request can hold; larger ones are refused
        # before anything is allocated.
        self.max_elements = batching.max_batch_size * model.max_row_elements()
        self._ready = False
        self._stopping = False
        self.lone = LoneRequests()  # the requests in flight, and whether one is alone (runs inline)
        self.rebucket = None  # an assembly/rebucket.BatchSizeRebucketing when batch_sizes is auto

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self._batcher.start()
        self.monitor = CoreMonitor(self.runner.cores.cores, self.name, self.replica, emulated())
        self.monitor.start()
        self._ready = True

    def grow(self, model: CompiledModel) -> None:
        """Serve ``model`` from now on: this model with more compiled models, one compiled in the
        background (call it from the compile queue's thread: loading onto the cores compiles)."""
        if self._stopping:  # a compile that ended as the replica stopped: nothing to serve it on
            return
        self.runner.grow(model)
        self.observer.loaded(model, self.runner)
        self.outputs = _outputs(model)
        self.observer.compile_counts(self.compile_state())
        self.host_memory()  # the metric, with the model that joined

    def _compile_event(self, job: CompileJob) -> None:
        """A job of the model's compile was queued (on the submitting thread), started or ended (on the compile
        queue's thread)."""
        self.observer.compile_job(job)
        self.observer.compile_counts(self.compile_state())

    async def stop(self) -> None:
        self._stopping = True
        self._ready = False
        if self.compiles is not None:
            self.compiles.cancel()  # what has not started compiling never will for this replica
        if self._unsubscribe is not None:
            self._unsubscribe()
        await self._batcher.stop(drain=True)
        self.observer.deferred.flush()
        if self.usage is not None:
            self.usage.save()
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
                "compile": self.compile_state(),
                # What the replica holds of host memory: weights once a core, each compiled model's code
                # (assembly/host_memory.report)
                "host_memory": self.host_memory(),
                **({"padding": self.usage.summary()} if self.usage is not None else {}),
                **({"rebucketing": self.rebucket.describe()} if self.rebucket is not None else {}),
                **self.parameters,
            },
        }

    def host_memory(self) -> dict:
        """assembly/host_memory.report of the loaded models, exported as neuron_serve_host_memory_bytes: every core's
        weights and state, the weights' host copy, what each compiled model kept as it compiled ("bucket 1 batch
        8"), the resident set."""
        model = self.runner.model
        compiled = {f"bucket {i + 1} batch {b.batch_size}": b.host_bytes for i in range(len(model.buckets))
                    for b in model.grid(i) if b.host_bytes is not None}
        states = sum(t.numel() * t.element_size() for t in model.states) if model.stateful else 0
        report = host_memory.report(self.runner.held_weights(), states * len(self.runner.cores.cores), compiled,
                                    emulated())
        self.observer.host_memory(report)
        return report

    def compile_state(self) -> dict:
        """This replica's compiled models by state (``compiled``, ``pending``: queued or compiling,
        ``failed``), whether the rest compile in the background, and each failure's reason."""
        state = {"compiled": len([b for i in range(len(self.runner.model.buckets))
                                  for b in self.runner.model.grid(i)]), "pending": 0, "failed": 0}
        if self.compiles is not None:
            state = self.compiles.counts().as_dict()
            failures = self.compiles.failures()
            if failures:
                state["failures"] = [{"model": label, "error": reason} for label, reason in failures]
        # Compiled in the background only when built so (a model.yaml's grid, not an artifact or a pooling model).
        state["background"] = self.compiles is not None and self.config.background_compile
        return state

    async def _run_batch(self, items: list[tuple[list[torch.Tensor], triton_ext.RequestTimes]]) -> list:
        inline = await self.lone.alone(len(items))
        started = time.perf_counter()
        results = await self.runner.infer([tensors for tensors, _ in items], inline=inline)
        ran = time.perf_counter()
        for _, times in items:
            times.started, times.ran = started, ran
        if any(not isinstance(r, Exception) for r in results):
            self.observer.executed()
        if self.rebucket is not None:
            self.rebucket.observe()
        return results

    def triton_config(self) -> dict:
        """This model's configuration in Triton's ModelConfig JSON."""
        return triton_ext.model_config(self.config, self.metadata()["inputs"], self.outputs,
                                       self.runner.model.batch_sizes,
                                       emulated())

    def admit(self) -> None:
        """Raise Overloaded now when the request queue would refuse a request (full, or stopping).

        A route calls it before it reads and decodes a request body, so a burst past the
        queue bound costs next to nothing.
        """
        self._batcher.admit()

    def begin(self) -> InferCall:
        """A request's `InferCall`, to enter before its protocol decodes it (see the module's docstring)."""
        return InferCall(self)

    async def infer(self, request: InferRequest, call: InferCall | None = None) -> InferResponse:
        """Check a decoded request against the model, batch and run it; the answer.

        ``call`` is the request's `InferCall`, entered before decoding, so the decode and
        encode around this are timed with the request (Triton's compute_input and
        compute_output) and their failures counted; without one the request is counted
        from here.
        """
        if call is None:
            with InferCall(self) as call:
                return await self.infer(request, call)
        times = call.times
        times.decoded = time.perf_counter()
        tensors = check_inputs(request.inputs, self.inputs)
        rows = tensors[0].shape[0] if tensors[0].dim() else 1
        if rows > self.config.batching.max_batch_size:
            raise InvalidInput(
                f"the request has {rows} rows; this model accepts at most "
                f"{self.config.batching.max_batch_size} (batching.max_batch_size)."
            )
        outputs = await self.run(tensors, call)
        named = list(zip(self.runner.model.output_names, outputs))
        selected = select_outputs(request, named, self.name)
        call.rows = rows
        return InferResponse(self.name, "1", request.id, selected)


    async def run(self, tensors: list[torch.Tensor], call: InferCall) -> list[torch.Tensor]:
        """Batch and run rows already checked against the model; its outputs for them.

        For a plane built on this one (the pooling plane, which makes its inputs from text):
        the rows join other requests' in the request queue. Any number of rows: past
        ``batching.max_batch_size`` they run as a batch of their own.
        """
        return await self._batcher.submit((tensors, call.times), rows=tensors[0].shape[0])


def _outputs(model: CompiledModel) -> list[dict]:
    """The outputs as model metadata lists them (shapes from the compiled buckets)."""
    return [{"name": s.name, "datatype": TORCH_TO_DATATYPE.get(s.dtype, "FP32"), "shape": list(s.shape)}
            for s in model.signature().outputs]


_current: ModelDataPlane | None = None


def current() -> ModelDataPlane | None:
    """The data plane of this process's replica (a Serve replica holds one model)."""
    return _current


def set_current(plane: ModelDataPlane | None) -> None:
    global _current
    _current = plane
