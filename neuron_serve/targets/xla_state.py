"""One process, one XLA state: the lock every piece of XLA work takes, and what a failure of that state looks like.

torch-xla keeps its lazy graph, its metrics counters and its device data per process, and
several of its calls act on all of them at once: ``torch_xla.sync()`` takes in every live
tensor of a device, the dynamo bridge's trace clears every pending IR of the device
(``_clear_pending_irs``) and ``metrics.clear_counters()`` every counter. So a trace, a compile
or an operator-support probe that runs while another thread is half-way through its own
device work (a decode call whose cache buffers are donated and not yet replaced, a LoRA slot
being written) sees that thread's tensors: "Check failed: data()->tensor_data" or "Failed to
get computation by hash", which have nothing to do with the model being compiled.

:func:`exclusive` is the process's one device lock. What holds it: torch-xla's three calls that
act on the whole process (:func:`install` wraps them: the sync of every live tensor, the clearing
of every pending IR, the clearing of every counter), every operator-support probe, every write of
device state (the KV cache's slot copies, the LoRA buffers, a cache laid out over a group) and
every compiled call's dispatch (inputs moved, the executable launched, its aliased state
replaced). It is re-entrant. A trace or compile holds it only for those whole-process calls: the
rest of it (tracing its own tensors, XLA compiling them) runs beside serving, which it cannot
disturb, so a background compile delays a serving call by a sync, not by a compile. It covers
dispatch, not computation: an executable runs on the device after its call returns, and reading
its outputs (device data, no pending graph) needs no lock. docs/guides/serving.md has the
measured cost.

:func:`internal_failure` tells a failure of this state (or of the runtime: memory, an
interrupt) from a compiler's verdict on an operator: only a verdict is ever cached.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

_LOCK = threading.RLock()
_waits = {"count": 0, "seconds": 0.0}  # how often, and how long, a thread waited for another's XLA work

# Text that only torch-xla's or the runtime's own failures carry, never a compiler's refusal of an operator:
# internal checks (XLA_CHECK / TORCH_CHECK "Check failed"), absl's INTERNAL and RESOURCE_EXHAUSTED statuses,
# an executable evicted or never cached, the tracer's process-wide stacks, memory.
INTERNAL_MARKERS = (
    "Check failed",
    "INTERNAL:",
    "RESOURCE_EXHAUSTED",
    "Failed to get computation by hash",
    "out of memory",
    "Out of memory",
    "Cannot allocate memory",
    "Trying to pop empty mode stack",
    "is not tracked with proxy",
    "KeyboardInterrupt",
    "MemoryError",
    # the dynamo bridge restoring a counter another thread's metrics.clear_counters() dropped meanwhile
    "_xla_increment_counter(): incompatible function arguments",
)


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold the process's XLA state (re-entrant): no other thread's XLA work runs meanwhile."""
    if not _LOCK.acquire(blocking=False):
        started = time.perf_counter()
        _LOCK.acquire()
        _waits["count"] += 1
        _waits["seconds"] += time.perf_counter() - started
    try:
        yield
    finally:
        _LOCK.release()


# torch-xla's calls that act on every tensor or counter of the process, whoever calls them (torch_xla.sync,
# xm.mark_step, the dynamo bridge's trace, metrics.clear_counters all go through these).
PROCESS_WIDE = ("_xla_step_marker", "_clear_pending_irs", "_clear_xla_counters")


def install(torch_xla) -> None:
    """Make torch-xla's whole-process calls (:data:`PROCESS_WIDE`) hold :func:`exclusive`: a trace's sync can then
    never fall in the middle of another thread's call. Once per process (``pjrt.xla`` calls it on import)."""
    native = torch_xla._XLAC
    for name in PROCESS_WIDE:
        call = getattr(native, name, None)
        if call is None or getattr(call, "_holds_xla_state", False):
            continue

        def held(*args, _call=call, **kwargs):
            with exclusive():
                return _call(*args, **kwargs)
        held._holds_xla_state = True
        setattr(native, name, held)


def waits() -> dict[str, float]:
    """How many times a thread waited for another's XLA work in this process, and the seconds it waited."""
    return dict(_waits)


def internal_failure(failure: BaseException | str | None) -> bool:
    """Whether ``failure`` (an exception, or a reason as the compile cache stores it) is torch-xla's or the
    runtime's own (a state error, memory, an interrupt), not the compiler or torch-xla's lowering refusing an
    operator: such a failure says nothing about the operator, so it is never cached as a verdict."""
    if failure is None:
        return False
    if isinstance(failure, (MemoryError, KeyboardInterrupt)):
        return True
    text = failure if isinstance(failure, str) else f"{type(failure).__name__}: {failure}"
    return any(marker in text for marker in INTERNAL_MARKERS)


def clean_state(torch_xla) -> None:
    """Bring the process's XLA state back to rest before a retry: wait for what is running on the devices and
    drop the pending graph a failed trace left behind. Hold :func:`exclusive` around it and the retry: every
    other thread's device work ends before it leaves the lock, so what is dropped is the failed attempt's.
    ``torch_xla`` is the module ``pjrt.xla()`` imported (this module is below pjrt: pjrt installs it)."""
    torch_xla._XLAC._xla_wait_device_ops(devices=[])
    torch_xla._XLAC._clear_pending_irs(str(torch_xla.device()))
