"""The protocol-agnostic data plane of one model: metadata, readiness and inference.

HTTP routes and Ray deployments are thin adapters over this class (as KServe's
DataPlane), so it is tested with a local model and served by Ray alike.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Mapping

import torch

from .. import __version__, metrics
from ..config import ModelConfig
from ..errors import InvalidInput, NeuronServeError
from ..compile import cache as compile_cache
from ..runtime.batcher import DynamicBatcher
from ..runtime.runner import ModelRunner
from ..targets.runtime import emulated
from .oip import check_inputs, encode_infer_response, parse_infer_request
from .oip_types import TORCH_TO_DATATYPE, TensorSpec
from . import triton_ext
from .neuron_monitor import CoreMonitor

logger = logging.getLogger("neuron_serve")



class ModelDataPlane:
    """One model on one replica: builds it, batches its requests, speaks OIP v2."""

    def __init__(self, config: ModelConfig, base_dir: str | Path | None = None, replica: str | None = None) -> None:
        self.config = config
        self.name = config.name
        self.replica = replica or str(os.getpid())
        labels = {"model": self.name, "replica": self.replica}
        self._labels = labels
        started = time.perf_counter()
        self.runner = ModelRunner(config, base_dir, on_stage=self._on_stage)
        metrics.COMPILE_TIME.labels(**labels).observe(time.perf_counter() - started)
        store = compile_cache.current()
        for kind, stats in (store.stats.items() if store is not None else ()):
            metrics.CACHE_HITS.labels(**labels, cache=kind).inc(stats.hits)
        self.inputs = [self._spec(i) for i in range(len(config.inputs))]
        self.output_datatypes: list[str] = []
        batching = config.batching
        self.batcher = DynamicBatcher(
            self._run_batch,
            max_batch_size=batching.max_batch_size,
            max_queue_delay_s=batching.max_queue_delay_ms / 1000,
            max_queue_size=batching.max_queue_size,
            request_timeout_s=batching.request_timeout_s,
            preferred_batch_sizes=[self.runner.trace_batch] if config.dynamic_batch else None,
            max_concurrent_batches=2 * len(self.runner.cores),
            on_batch=self._on_batch,
        )
        self.max_elements = _max_elements(config)
        self._ready = False

    def _spec(self, index: int) -> TensorSpec:
        spec = self.config.inputs[index]
        shape = list(spec.shape)
        if self.config.dynamic_batch and shape:
            shape[0] = -1
        if self.config.buckets and spec.name in self.config.buckets.inputs:
            dims = self.config.buckets.inputs[spec.name]
            for d in [dims] if isinstance(dims, int) else dims:
                shape[d] = -1
        return TensorSpec(spec.name, TORCH_TO_DATATYPE[self.runner.input_dtypes()[index]], tuple(shape))

    # -- hooks for metrics ----------------------------------------------------------

    def _on_stage(self, partition: str, device: str, core: int, seconds: float) -> None:
        metrics.PARTITION_TIME.labels(**self._labels, partition=partition, device=device, core=str(core)).observe(seconds)
        if device != "cpu":
            metrics.CORE_BATCHES.labels(**self._labels, core=str(core)).inc()

    def _on_batch(self, rows: int, waits: list[float]) -> None:
        metrics.BATCH_SIZE.labels(**self._labels).observe(rows)
        for wait in waits:
            metrics.QUEUE_TIME.labels(**self._labels).observe(wait)
        if self.config.dynamic_batch:
            chunk = self.runner.trace_batch
            metrics.PADDING_ROWS.labels(**self._labels).inc(-rows % chunk)

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self.batcher.start()
        self.monitor = CoreMonitor(self.runner.cores.cores, self.name, self.replica, emulated())
        self.monitor.start()
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        await self.batcher.stop(drain=True)
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
            "outputs": [{"name": n, "datatype": d, "shape": [-1]} for n, d in
                        zip(self.runner.output_names, self.output_datatypes or ["FP32"] * len(self.runner.output_names))],
            "parameters": {
                "emulated": emulated(),
                "cores": len(self.runner.cores),
                "partitions": self.runner.partitions,
                "neuron_serve_version": __version__,
            },
        }

    async def _run_batch(self, items: list[tuple[list[torch.Tensor], triton_ext.RequestTimes]]) -> list:
        started = time.perf_counter()
        results = await self.runner.infer([tensors for tensors, _ in items])
        ran = time.perf_counter()
        for _, times in items:
            times.started, times.ran = started, ran
        if any(not isinstance(r, Exception) for r in results):
            metrics.EXECUTIONS.labels(**self._labels).inc()
        return results

    def triton_config(self) -> dict:
        """This model's configuration in Triton's ModelConfig JSON."""
        meta = self.metadata()
        return triton_ext.model_config(self.config, meta["inputs"], self._output_specs(), self.runner.trace_batch,
                                       emulated())

    def _output_specs(self) -> list[dict]:
        """Output tensors with their traced shapes (batch dim and bucketed dims -1)."""
        traced = self.runner.buckets[0]
        bucketed = self.config.buckets.outputs if self.config.buckets else {}
        specs = []
        for i, (name, datatype) in enumerate(zip(self.runner.output_names, self.output_datatypes or
                                                 ["FP32"] * len(self.runner.output_names))):
            shape = traced.output_shapes[i] if i < len(traced.output_shapes) else None
            dims = [-1] if shape is None else list(shape)
            if shape is not None and self.config.dynamic_batch and dims:
                dims[0] = -1
            cut = bucketed.get(name, [])
            for d in [cut] if isinstance(cut, int) else cut:
                if d < len(dims):
                    dims[d] = -1
            specs.append({"name": name, "datatype": datatype, "shape": dims})
        return specs

    async def infer(self, body: bytes, headers: Mapping[str, str]) -> tuple[bytes, dict[str, str]]:
        """Decode, batch, run and encode one OIP v2 infer request."""
        started = time.perf_counter()
        times = triton_ext.RequestTimes(received=started)
        code, rows = "500", 0
        try:
            request = parse_infer_request(body, headers, max_elements=self.max_elements)
            tensors = check_inputs(request.inputs, self.inputs)
            rows = tensors[0].shape[0] if tensors[0].dim() else 1
            if rows > self.config.batching.max_batch_size:
                raise InvalidInput(
                    f"the request has {rows} rows; this model accepts at most "
                    f"{self.config.batching.max_batch_size} (batching.max_batch_size)."
                )
            times.decoded = time.perf_counter()
            outputs = await self.batcher.submit((tensors, times), rows=rows)
            named = list(zip(self.runner.output_names, outputs))
            if not self.output_datatypes:
                self.output_datatypes = [TORCH_TO_DATATYPE.get(t.dtype, "FP32") for _, t in named]
            response = encode_infer_response(
                model_name=self.name, model_version="1", request_id=request.id, outputs=named, request=request
            )
            code = "200"
            times.answered = time.perf_counter()
            return response
        except NeuronServeError as exc:
            code = str(exc.http_status)
            raise
        finally:
            triton_ext.record(self.name, self.replica, times, code == "200", rows)
            metrics.REQUESTS.labels(**self._labels, code=code).inc()
            metrics.REQUEST_LATENCY.labels(**self._labels).observe(time.perf_counter() - started)


def _max_elements(config: ModelConfig) -> int:
    """The most elements one input of a valid request can hold; larger ones are refused
    before anything is allocated."""
    largest_bucket = max(max(s) if isinstance(s, list) else s for s in config.buckets.sizes) if config.buckets else 1
    per_row = max(int(torch.Size(i.shape[1:]).numel()) for i in config.inputs)
    return config.batching.max_batch_size * per_row * largest_bucket


_current: ModelDataPlane | None = None


def current() -> ModelDataPlane | None:
    """The data plane of this process's replica (a Serve replica holds one model)."""
    return _current


def set_current(plane: ModelDataPlane | None) -> None:
    global _current
    _current = plane
