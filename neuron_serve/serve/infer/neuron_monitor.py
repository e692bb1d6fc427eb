"""NeuronCore metrics of one replica, published under neuron-monitor's Prometheus names.

A daemon thread samples each core's activity (see neuron_serve.runtime.cores) every
``period_s`` seconds, as neuron-monitor reports every period: utilization is the core
thread's busy time over the wall time of the period (an execution still running counts
up to now, so the ratio never passes 1); execution outcomes are added to
``execution_status_total``; latency percentiles are those of the executions that ended
in the period, and are left as they were in a period without any (as neuron-monitor does).
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ... import metrics
from ...runtime.cores import Core

PERIOD_S = 1.0
PERCENTILES = {"p0": 0, "p1": 1, "p25": 25, "p50": 50, "p75": 75, "p99": 99, "p100": 100}  # neuron-monitor's


def core_ids(count: int, visible: str | None = None) -> list[str]:
    """The NeuronCore index of each local core: from NEURON_RT_VISIBLE_CORES ("2-3" or
    "2,3") when the runtime was given cores, else 0..count-1 (emulated cores)."""
    visible = os.environ.get("NEURON_RT_VISIBLE_CORES") if visible is None else visible
    ids: list[str] = []
    for part in (visible or "").split(","):
        first, _, last = part.strip().partition("-")
        if first.isdigit():
            ids.extend(str(i) for i in range(int(first), int(last or first) + 1))
    return ids[:count] if len(ids) >= count else [str(i) for i in range(count)]


class CoreMonitor:
    """Samples the cores of one replica into the neuron-monitor metrics until stopped."""

    def __init__(self, cores: list[Core], model: str, replica: str, emulated: bool, period_s: float = PERIOD_S):
        self.cores = cores
        self.period_s = period_s
        self.labels = {"model": model, "replica": replica, "runtime_tag": str(os.getpid()),
                       "emulated": str(emulated).lower()}
        self.ids = core_ids(len(cores))
        self._last = [core.activity.snapshot()[:4] for core in cores]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="neuron-monitor", daemon=True)
        for ident in self.ids:
            metrics.NEURONCORE_UTILIZATION.labels(**self.labels, neuroncore=ident).set(0.0)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Publish the last period, then mark the cores idle (this replica stops executing)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()
        for ident in self.ids:
            metrics.NEURONCORE_UTILIZATION.labels(**self.labels, neuroncore=ident).set(0.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        """Publish one period of every core."""
        latencies: list[float] = []
        completed = failed = 0
        for i, core in enumerate(self.cores):
            now, busy, done, errors, recent = core.activity.snapshot()
            then, busy_before, done_before, errors_before = self._last[i]
            self._last[i] = (now, busy, done, errors)
            if now > then:
                ratio = min(max((busy - busy_before) / (now - then), 0.0), 1.0)
                metrics.NEURONCORE_UTILIZATION.labels(**self.labels, neuroncore=self.ids[i]).set(ratio)
            completed += done - done_before
            failed += errors - errors_before
            latencies.extend(recent)
        if completed:
            metrics.EXECUTION_STATUS.labels(**self.labels, status_type="completed").inc(completed)
        if failed:
            metrics.EXECUTION_STATUS.labels(**self.labels, status_type="completed_with_err").inc(failed)
            metrics.EXECUTION_ERRORS.labels(**self.labels, error_type="generic").inc(failed)
        if latencies:
            values = np.percentile(np.asarray(latencies), list(PERCENTILES.values()))
            for name, value in zip(PERCENTILES, values):
                metrics.EXECUTION_LATENCY.labels(**self.labels, percentile=name).set(float(value))
