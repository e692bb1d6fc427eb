"""Starting torch-xla's PJRT runtime: Neuron devices when present, XLA:CPU otherwise.

torch_xla reads PJRT_DEVICE when it is first imported, so every import of torch_xla in
neuron-serve goes through :func:`xla` after the environment is set.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from typing import Any, Callable

logger = logging.getLogger("neuron_serve")

DEFAULT_EMULATED_CORES = 1
_pool_threads: int | None = None  # XLA:CPU's compute threads, when start_emulated_cores_on_threads chose them


def neuron_devices_present() -> bool:
    """True on an Inf2/Trn1 machine: the Neuron driver exposes /dev/neuron*."""
    return bool(glob.glob("/dev/neuron[0-9]*"))


def emulated() -> bool:
    """Cores are XLA:CPU devices unless PJRT runs on real NeuronCores."""
    return os.environ.get("PJRT_DEVICE", "").upper() != "NEURON"


@functools.cache
def xla():
    """Import torch_xla once, with PJRT pointed at Neuron devices or XLA:CPU."""
    if "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = "NEURON" if neuron_devices_present() else "CPU"
    if os.environ["PJRT_DEVICE"].upper() == "CPU":
        os.environ.setdefault("CPU_NUM_DEVICES", str(DEFAULT_EMULATED_CORES))
        logger.info(
            "No NeuronCores found: emulating %s NeuronCore(s) on XLA:CPU devices "
            "(placement still follows the Neuron support profile).",
            os.environ["CPU_NUM_DEVICES"],
        )
    import torch_xla  # noqa: PLC0415 - must follow the environment set above

    from . import xla_state  # noqa: PLC0415

    xla_state.install(torch_xla)
    return torch_xla


THREADS_ENV = "NEURON_SERVE_EMULATED_CORE_THREADS"


def emulated_core_threads() -> int | None:
    """XLA:CPU's compute threads per emulated core of a replica, from ``$NEURON_SERVE_EMULATED_CORE_THREADS`` (None:
    its own pool, a thread per CPU the process may use, whatever the cores)."""
    given = os.environ.get(THREADS_ENV)
    if not given:
        return None
    if not given.isdigit() or int(given) < 1:
        from ..errors import ConfigError  # noqa: PLC0415

        raise ConfigError(f"${THREADS_ENV}: give a number of threads (at least 1), or unset it for one per CPU; "
                          f"got {given!r}.")
    return int(given)


def start_emulated_cores_on_threads(threads: int) -> bool:
    """Start XLA:CPU's runtime with ``threads`` compute threads instead of one per host CPU.

    An emulated NeuronCore computes on the host's CPUs, where a real one leaves them to the
    host's serving work. XLA:CPU splits each operation over a pool of one thread per CPU
    the process may run on when its client starts; torch-xla has no option for the
    pool's size. So the client starts under an affinity of ``threads`` CPUs, and every
    thread gets the process's CPUs back once it has. True if the pool was made smaller;
    False on Neuron, when the client already runs, or when ``threads`` covers every CPU.
    """
    torch_xla = xla()  # first: it decides between Neuron and emulation
    allowed = sorted(os.sched_getaffinity(0))
    if not emulated() or threads >= len(allowed) or torch_xla._XLAC._xla_runtime_is_initialized():
        return False
    global _pool_threads
    os.sched_setaffinity(0, allowed[:threads])
    _pool_threads = threads
    try:
        torch_xla.device(0)  # creates the PJRT client, and with it XLA:CPU's pools
    finally:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), allowed)
            except OSError:  # a thread that ended meanwhile
                pass
    return True


def computes_in_sequence() -> bool:
    """Whether each core computes one operation at a time, on one thread: a NeuronCore does; an emulated
    core does when XLA:CPU's pool has no more threads than there are cores (the replica's engine process),
    not when one process's cores share every CPU of the host (``engine_for`` in a script)."""
    if not emulated():
        return True
    threads = _pool_threads or len(os.sched_getaffinity(0))
    return threads <= int(os.environ.get("CPU_NUM_DEVICES", DEFAULT_EMULATED_CORES))


def use_device(device: Any) -> None:
    """Make ``device`` this thread's default XLA device.

    torch-xla replays a cached executable on the calling thread's default device, so
    each core is driven from its own thread with its own default; without this, a
    subgraph loaded on xla:1 would run against xla:0.
    """
    xla()._XLAC._xla_set_default_device(str(device))


def on_this_thread(work: Callable[[], Any]) -> Any:
    """``work()`` on this thread, which keeps its default XLA device: loading a subgraph onto a
    core makes that core the loading thread's default (:func:`use_device`)."""
    before = xla()._XLAC._xla_get_default_device()
    try:
        return work()
    finally:
        use_device(before)


def versions() -> dict[str, str]:
    """Versions that decide compiled results; part of every cache key and report."""
    import torch  # noqa: PLC0415

    from ..version import __version__  # noqa: PLC0415

    return {
        "torch_version": torch.__version__,
        "torch_xla_version": xla().__version__,
        "neuron_serve_version": __version__,
    }
