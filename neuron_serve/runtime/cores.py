"""NeuronCores of one replica: one device and one driving thread per core.

Emulated cores are XLA:CPU devices (``CPU_NUM_DEVICES`` of them); on Neuron they are
the NeuronCores visible to the process. Each core has a single thread whose default
XLA device is that core, so every executable it replays runs there.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError
from ..targets.pjrt import use_device, xla


@dataclass
class Core:
    index: int
    device: Any
    executor: ThreadPoolExecutor

    def submit(self, fn: Callable, *args: Any) -> Future:
        return self.executor.submit(fn, *args)


class CorePool:
    """The cores of this process, handed out round-robin."""

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

    def __len__(self) -> int:
        return len(self.cores)

    def next(self) -> Core:
        with self._lock:
            return next(self._order)

    def shutdown(self) -> None:
        for core in self.cores:
            core.executor.shutdown(wait=True)
