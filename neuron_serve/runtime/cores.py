"""NeuronCores of one replica: one device and one driving thread per core.

Emulated cores are XLA:CPU devices (``CPU_NUM_DEVICES`` of them); on Neuron they are
the NeuronCores visible to the process. Each core has a single thread whose default
XLA device is that core, so every executable it replays runs there.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError
from ..targets.pjrt import use_device, xla


class CoreActivity:
    """What a core's thread has executed: busy seconds, outcomes and recent latencies.

    Read by the NeuronCore metrics (busy time over wall time is the utilization);
    written only by the core's own thread, read from another, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0.0
        self._running_since: float | None = None
        self.completed = 0
        self.failed = 0
        self._latencies: list[float] = []

    def begin(self) -> float:
        now = time.perf_counter()
        with self._lock:
            self._running_since = now
        return now

    def end(self, started: float, ok: bool) -> None:
        now = time.perf_counter()
        with self._lock:
            self._running_since = None
            self._busy += now - started
            self._latencies.append(now - started)
            if ok:
                self.completed += 1
            else:
                self.failed += 1

    def snapshot(self) -> tuple[float, float, int, int, list[float]]:
        """(now, busy seconds so far including a running execution, completed, failed,
        latencies since the last snapshot)."""
        now = time.perf_counter()
        with self._lock:
            busy = self._busy + (now - self._running_since if self._running_since is not None else 0.0)
            latencies, self._latencies = self._latencies, []
            return now, busy, self.completed, self.failed, latencies


@dataclass
class Core:
    index: int
    device: Any
    executor: ThreadPoolExecutor
    activity: CoreActivity = field(default_factory=CoreActivity)

    def submit(self, fn: Callable, *args: Any) -> Future:
        return self.executor.submit(fn, *args)

    def execute(self, fn: Callable, *args: Any) -> Any:
        """Run one execution on this core's thread (call it there), counted in ``activity``."""
        started = self.activity.begin()
        try:
            result = fn(*args)
        except BaseException:
            self.activity.end(started, ok=False)
            raise
        self.activity.end(started, ok=True)
        return result


class CorePool:
    """The cores of this process, handed out to chunks: the core that ran last while it is idle, else round-robin.

    A lone request on an idle replica keeps going to the same core. Each emulated core
    holds its own copy of the weights, and alternating made every call read the other
    copy out of cache: on one 2-vCPU machine the example MLP's batch-1 request took
    4.68 ms through the runner against 2.47 on the core that ran last (bench.latency,
    in process). Under load a core is busy when the next chunk
    comes, and chunks spread round-robin over the idle ones as before.
    """

    def __init__(self, count: int) -> None:
        torch_xla = xla()
        import torch_xla.runtime as xr  # noqa: PLC0415

        available = xr.addressable_device_count()
        if count < 1 or count > available:
            raise ConfigError(
                f"cores_per_replica is {count} but this process sees {available} core(s) "
                f"(PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}, CPU_NUM_DEVICES={os.environ.get('CPU_NUM_DEVICES')})."
            )
        self.cores = []
        for index in range(count):
            device = torch_xla.device(index)
            executor = ThreadPoolExecutor(1, thread_name_prefix=f"core{index}", initializer=use_device, initargs=(device,))
            self.cores.append(Core(index, device, executor))
        self._order = itertools.cycle(self.cores)
        self._lock = threading.Lock()
        self._last: Core | None = None
        self._running = {core.index: 0 for core in self.cores}  # chunks handed out and not yet released

    def __len__(self) -> int:
        return len(self.cores)

    def lead_every(self, span: int, copies: int) -> None:
        """Hand out only the first core of each of ``copies`` groups of ``span`` cores (pipelined models)."""
        self._order = itertools.cycle(self.cores[: copies * span : span])
        self._last = None

    def next(self) -> Core:
        """A core for one chunk; give it back with :meth:`release` when the chunk is done."""
        with self._lock:
            core = self._last
            if core is None or self._running[core.index]:
                core = next(self._order)
                for _ in range(len(self.cores)):  # an idle core before a busy one
                    if not self._running[core.index]:
                        break
                    core = next(self._order)
            self._running[core.index] += 1
            self._last = core
            return core

    def busy(self) -> int:
        """Chunks handed out and not yet released, on all cores."""
        with self._lock:
            return sum(self._running.values())

    def release(self, core: Core) -> None:
        with self._lock:
            self._running[core.index] -= 1

    def shutdown(self) -> None:
        for core in self.cores:
            core.executor.shutdown(wait=True)
