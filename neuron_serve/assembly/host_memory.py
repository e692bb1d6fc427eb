"""Host memory as a budget the compile queue keeps, not a surprise.

A compile allocates far more than it keeps (a 30-layer model's graph traced three times by
the dynamo bridge, XLA's passes, LLVM): SmolLM2's prefill of 512 tokens peaks about 2.5 GiB
above what the process held before it, and keeps about 0.1 GiB. A replica that starts such
a compile on a machine without the room is killed by the kernel or by Ray's memory monitor
(which kills a worker once the node uses ``RAY_memory_usage_threshold``, 95%, of its memory),
and its serving with it. So before a compile starts the queue asks :class:`Budget` whether it
fits: what the process holds now (its resident set), what the compile needs (the peak growth
measured on the last compile of its family: a model's prefills, its decodes, a load onto
another core; the largest measured so far for a family not yet seen) and the room left, the
least of:

- the machine's: available memory less what Ray's memory monitor keeps back;
- the container's (cgroup v2 ``memory.max`` less ``memory.current``), when it has a limit;
- the process's: ``NEURON_SERVE_HOST_MEMORY_BYTES`` less its resident set, when set.

A compile that does not fit waits (the queue runs the others, and looks again as each ends);
one that still does not fit after ``NEURON_SERVE_COMPILE_MEMORY_WAIT_S`` seconds (60) is
skipped, and the replica serves on the models it has. Each is logged with the bucket and the
bytes. Linux only (``/proc``); elsewhere nothing is measured and every compile runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

logger = logging.getLogger("neuron_serve")

BUDGET_ENV = "NEURON_SERVE_HOST_MEMORY_BYTES"
WAIT_ENV = "NEURON_SERVE_COMPILE_MEMORY_WAIT_S"
DEFAULT_WAIT_S = 60.0
RAY_THRESHOLD_ENV = "RAY_memory_usage_threshold"
RAY_DEFAULT_THRESHOLD = 0.95
GIB = 1 << 30
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_LIBC: Any = None


def release_freed_heap() -> None:
    """Give the memory a compile freed back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    A compile allocates and frees gigabytes (the graph copied and laid out, XLA's and LLVM's passes) on the
    queue's thread, whose malloc arena keeps what was freed: a SmolLM2 replica's resident memory grew by about
    2 GB a compiled model, 16.3 GB after five of them, 9.9 GB once trimmed, and Ray's memory monitor killed the
    replica before its background compile ended."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t] if _LIBC else None
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def resident_bytes() -> int:
    """This process's resident set (0 where /proc is not there)."""
    text = _read("/proc/self/statm")
    return int(text.split()[1]) * _PAGE if text else 0


def _status_kib(field: str) -> int | None:
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def peak_resident_bytes() -> int | None:
    """The process's peak resident set since it started or since :func:`reset_peak` (VmHWM)."""
    return _status_kib("VmHWM")


def reset_peak() -> bool:
    """Start measuring the peak resident set afresh (``clear_refs`` 5, Linux 4.0 and newer); False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _meminfo() -> dict[str, int]:
    found = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            found[name] = int(parts[0]) * 1024
    return found


def _ray_threshold() -> float:
    try:
        return float(os.environ.get(RAY_THRESHOLD_ENV, RAY_DEFAULT_THRESHOLD))
    except ValueError:
        return RAY_DEFAULT_THRESHOLD


def budget_bytes() -> int | None:
    """``NEURON_SERVE_HOST_MEMORY_BYTES``: the most this process may hold; None when not set."""
    value = os.environ.get(BUDGET_ENV)
    if not value:
        return None
    try:
        budget = int(value)
    except ValueError:
        logger.warning("%s=%r is not a whole number of bytes; ignored", BUDGET_ENV, value)
        return None
    return budget if budget > 0 else None


def wait_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S)))
    except ValueError:
        return DEFAULT_WAIT_S


@dataclass(frozen=True)
class Room:
    """The bytes a compile may still take and what limits them."""

    bytes: int | None  # None: nothing could be measured (not Linux): every compile runs
    limit: str


def room() -> Room:
    """The least room of the machine (less what Ray's memory monitor keeps back), the container and the budget."""
    options: list[tuple[int, str]] = []
    info = _meminfo()
    if "MemAvailable" in info and "MemTotal" in info:
        kept = int((1 - _ray_threshold()) * info["MemTotal"])
        options.append((info["MemAvailable"] - kept, f"the machine's available memory less the {1 - _ray_threshold():.0%} "
                                                     f"Ray's memory monitor keeps back"))
    limit, current = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit and current and limit.strip() != "max":
        options.append((int(limit) - int(current), "the container's memory limit"))
    budget = budget_bytes()
    if budget is not None:
        options.append((budget - resident_bytes(), f"{BUDGET_ENV}={budget}"))
    if not options:
        return Room(None, "unmeasured")
    least = min(options)
    return Room(max(0, least[0]), least[1])


def gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


@dataclass
class Measured:
    """One job's memory: its peak growth over the resident set it started from, and what it kept."""

    peak: int | None = None
    kept: int | None = None


class Budget:
    """What each family of compiles needs (measured), and whether the next one fits the room left."""

    def __init__(self) -> None:
        self._needs: dict[str, int] = {}
        self._lock = threading.Lock()

    def expect(self, family: str, peak: int) -> None:
        """A need known before this process measured one (a record of a previous start, :func:`remembered`)."""
        with self._lock:
            self._needs.setdefault(family, peak)

    def need(self, family: str) -> int | None:
        """Bytes a compile of ``family`` is expected to take at its peak: the most a compile of the family took in
        this process, or the most any family took; None before anything is measured."""
        with self._lock:
            if family in self._needs:
                return self._needs[family]
            return max(self._needs.values(), default=None)

    def fits(self, family: str) -> tuple[bool, int | None, Room]:
        """(fits, need, room): whether a compile of ``family`` fits now; one with nothing measured always does, and
        none does once no room is left (a need is an estimate)."""
        need, left = self.need(family), room()
        if need is None or left.bytes is None:
            return True, need, left
        return 0 < left.bytes and need <= left.bytes, need, left

    @contextlib.contextmanager
    def measure(self, family: str) -> Iterator[Measured]:
        """Measure the block (a job) as a compile of ``family``: its peak growth becomes the family's need."""
        measured = Measured()
        before = resident_bytes()
        peaked = reset_peak()
        try:
            yield measured
        finally:
            release_freed_heap()  # what it kept, not what malloc has yet to give back
            after = resident_bytes()
            peak = peak_resident_bytes() if peaked else None
            if before and peak is not None:
                measured.peak = max(0, peak - before)
                with self._lock:  # a graph XLA had compiled already costs nothing: it does not lower the need
                    self._needs[family] = max(measured.peak, self._needs.get(family, 0))
            if before:
                measured.kept = after - before


@contextlib.contextmanager
def kept(placed: Callable[[], int] = lambda: 0) -> Iterator[Measured]:
    """Measure what the block (one compiled model) keeps of host memory once it ends: the growth of the resident set,
    less the growth of ``placed()`` (bytes it put on a core that are not its own: the weights and cache the first
    compile places, which the report counts apart)."""
    measured = Measured()
    release_freed_heap()
    before, placed_before = resident_bytes(), placed()
    yield measured
    release_freed_heap()
    if before:
        measured.kept = max(0, resident_bytes() - before - (placed() - placed_before))


def report(weights: Iterable[Any], cache_bytes: int, compiled: dict[str, int], cores_in_host_memory: bool) -> dict:
    """What the process holds of host memory, by what for: its resident set; the weights' copy of record on the host
    (what compiles trace and further cores are loaded from); every core's copy of the weights (``weights``: the
    held weights of compile/core_weights.py) and the KV cache, host memory when the cores are emulated; and what each
    compiled model kept (its code and bookkeeping, measured as it compiled)."""
    unique = {id(w): w for w in weights}.values()
    hosts = {(w.host.untyped_storage().data_ptr(), w.host.storage_offset(), w.host.numel(), w.host.dtype):
             w.host.numel() * w.host.element_size() for w in unique}
    return {"resident_bytes": resident_bytes(), "weights_bytes": sum(hosts.values()),
            "weights_on_cores_bytes": sum(w.share * w.devices for w in unique), "kv_cache_bytes": cache_bytes,
            "compiled_models_bytes": dict(compiled), "compiled_models_total_bytes": sum(compiled.values()),
            "cores_in_host_memory": cores_in_host_memory}


def summed(reports: Iterable[dict]) -> dict:
    """Reports of several processes (a replica's tensor-parallel groups) as one: bytes added up, each compiled
    model's over the processes."""
    reports = [r for r in reports if r]
    if not reports:
        return {}
    total: dict = {"compiled_models_bytes": {}}
    for one in reports:
        for key, value in one.items():
            if key == "compiled_models_bytes":
                for label, bytes_ in value.items():
                    total[key][label] = total[key].get(label, 0) + bytes_
            elif isinstance(value, bool):
                total[key] = value
            elif isinstance(value, int):
                total[key] = total.get(key, 0) + value
    return total

