"""Triton's model configuration and statistics extensions of OIP v2.

``GET /v2/models/{name}/config`` answers the model's configuration in Triton's
``ModelConfig`` JSON (``max_batch_size``, ``input``/``output`` with ``data_type`` and
``dims``, ``dynamic_batching``, ``instance_group``), and ``GET /v2/models/{name}/stats``
its statistics in Triton's ``ModelStatistics`` JSON, so Triton's tools (perf_analyzer,
model analyzer, tritonclient) read them unchanged.

Statistics are read back from the Prometheus samples every replica writes (see
neuron_serve.metrics), so they sum all replicas of the model on this node, whichever
replica answers.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client import multiprocess

from ... import metrics
from ...config.schema import ModelConfig

EXTENSIONS = ["binary_tensor_data", "generate", "model_configuration", "statistics"]
DURATION_STATS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
# Triton's data_type names (model_config.proto) for OIP v2 datatypes.
_TRITON_TYPES = {
    "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16", "UINT32": "TYPE_UINT32",
    "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8", "INT16": "TYPE_INT16", "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64", "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64",
    "BF16": "TYPE_BF16", "BYTES": "TYPE_STRING",
}


def triton_type(datatype: str) -> str:
    """Triton's ``TYPE_*`` name of an OIP v2 datatype such as ``FP32``."""
    return _TRITON_TYPES[datatype]


def model_config(config: ModelConfig, inputs: list[dict], outputs: list[dict], batch_sizes: list[int],
                 emulated: bool) -> dict:
    """Triton's model configuration of one model.

    ``inputs``/``outputs`` are the model metadata's tensors (name, datatype, shape with
    -1 for variable dims). With dynamic batching the batch dim is left out of ``dims`` and
    ``max_batch_size`` is ``batching.max_batch_size``, as Triton does for batching models;
    without it the model takes exactly its traced shapes and ``max_batch_size`` is 0.
    """
    batching = config.batching
    batched = config.dynamic_batch

    def tensors(specs: list[dict]) -> list[dict]:
        return [{"name": s["name"], "data_type": triton_type(s["datatype"]),
                 "dims": list(s["shape"][1:] if batched and s["shape"] else s["shape"])} for s in specs]

    replicas = config.autoscaling.min_replicas if config.autoscaling is not None else config.replicas
    return {
        "name": config.name,
        "platform": f"neuron-serve/{config.target}" + ("-emulated" if emulated else ""),
        "backend": "neuron-serve",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": batching.max_batch_size if batched else 0,
        "input": tensors(inputs),
        "output": tensors(outputs),
        "dynamic_batching": {
            "preferred_batch_size": list(batch_sizes) if batched else [],  # the compiled batch sizes
            "max_queue_delay_microseconds": int(batching.max_queue_delay_ms * 1000),
            "preserve_ordering": False,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": int(batching.request_timeout_s * 1_000_000),
                "allow_timeout_override": False,
                "max_queue_size": batching.max_queue_size,
            },
        },
        # One execution instance per core: each core runs one batch chunk at a time.
        "instance_group": [{
            "name": config.name,
            "kind": "KIND_MODEL",
            "count": config.cores_per_replica * replicas,
        }],
        "parameters": {"target": {"string_value": config.target},
                       "emulated": {"string_value": str(emulated).lower()},
                       "cores_per_replica": {"string_value": str(config.cores_per_replica)},
                       "replicas": {"string_value": str(replicas)}},
    }


@dataclass
class RequestTimes:
    """Where one infer request spent its time, in perf_counter seconds (for the stats)."""

    received: float = field(default_factory=time.perf_counter)
    decoded: float | None = None
    started: float | None = None  # its batch began running
    ran: float | None = None      # its batch returned
    answered: float | None = None


STATS = ("success", "fail", "compute_input", "queue", "compute_infer", "compute_output")


@functools.lru_cache(maxsize=256)
def _children(model: str, replica: str) -> dict:
    """The labelled counters of one model replica, looked up once: ``labels()`` costs a
    few microseconds a call, and a request records a dozen samples."""
    labels = {"model": model, "replica": replica}
    return {
        "stats": {stat: (metrics.INFER_STAT_COUNT.labels(**labels, stat=stat),
                         metrics.INFER_STAT_SECONDS.labels(**labels, stat=stat)) for stat in STATS},
        "inferences": metrics.INFERENCES.labels(**labels),
        "last": metrics.LAST_INFERENCE.labels(**labels),
    }


def record(model: str, replica: str, times: RequestTimes, ok: bool, rows: int) -> None:
    """Count one finished request in Triton's statistics (Prometheus counters)."""
    children = _children(model, replica)
    stats = children["stats"]
    end = times.answered or time.perf_counter()

    def add(stat: str, seconds: float) -> None:
        count, total = stats[stat]
        count.inc()
        total.inc(max(seconds, 0.0))

    if not ok:
        add("fail", end - times.received)
        return
    # Triton counts the stage durations of successful requests only.
    add("success", end - times.received)
    add("compute_input", times.decoded - times.received)
    add("queue", times.started - times.decoded)
    add("compute_infer", times.ran - times.started)
    add("compute_output", end - times.ran)
    children["inferences"].inc(rows)
    children["last"].set(time.time())


def _samples() -> dict[str, dict[tuple, float]]:
    """Every neuron-serve statistics sample on this node, summed over replicas:
    metric sample name -> {(model, stat) -> value}."""
    wanted = {"neuron_serve_inference_stat_count_total", "neuron_serve_inference_stat_seconds_total",
              "neuron_serve_executions_total", "neuron_serve_inferences_total",
              "neuron_serve_last_inference_timestamp_seconds"}
    found: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    for family in multiprocess.MultiProcessCollector(None, path=metrics.multiproc_dir()).collect():
        for sample in family.samples:
            if sample.name not in wanted:
                continue
            key = (sample.labels.get("model"), sample.labels.get("stat"))
            if sample.name.endswith("timestamp_seconds"):
                found[sample.name][key] = max(found[sample.name][key], sample.value)
            else:
                found[sample.name][key] += sample.value
    return found


def model_stats(names: list[str]) -> dict:
    """Triton's ``ModelStatistics`` JSON of ``names``: ``{"model_stats": [...]}``."""
    found = _samples()
    counts = found["neuron_serve_inference_stat_count_total"]
    seconds = found["neuron_serve_inference_stat_seconds_total"]
    stats = []
    for name in names:
        def duration(stat: str) -> dict:
            return {"count": int(counts[(name, stat)]), "ns": int(round(seconds[(name, stat)] * 1e9))}

        stats.append({
            "name": name,
            "version": "1",
            "last_inference": int(found["neuron_serve_last_inference_timestamp_seconds"][(name, None)] * 1000),
            "inference_count": int(found["neuron_serve_inferences_total"][(name, None)]),
            "execution_count": int(found["neuron_serve_executions_total"][(name, None)]),
            "inference_stats": {
                **{stat: duration(stat) for stat in DURATION_STATS},
                # No response cache: every request runs the model.
                "cache_hit": {"count": 0, "ns": 0},
                "cache_miss": {"count": 0, "ns": 0},
            },
            "batch_stats": [],
            "memory_usage": [],
        })
    return {"model_stats": stats}
