"""One compile queue per process: every compile runs on its one worker thread, most urgent first.

torch.export and torch-xla's tracing keep process-wide state (torch's dispatch-mode stack,
the lazy graph being traced), so two compiles on two threads at once fail ("Trying to pop
empty mode stack", "... is not tracked with proxy"). A replica therefore hands every compile
(its start-up buckets, the rest in the background, a variant needed later) to this queue,
which runs them one at a time on one thread, never inside a request or an engine step::

    queue = compile_queue()
    job = queue.submit("mlp batch 64", compile_it, priority=READY, group="mlp")
    queue.wait([job])             # or job.future.result(): the compiled thing, or its error
    queue.counts("mlp")           # Counts(compiled=1, pending=0, running=0, failed=0)

A job's ``priority`` orders the queue (lower runs first: ``READY`` before ``NEEDED`` before
``BACKGROUND``), then the order of submission; ``promote`` moves a pending job up, for a
request that waits for it. A job that raises is recorded ``failed`` with its reason (logged,
counted, its future holding the exception); the worker goes on with the next. ``kind``
separates what counts as a compiled model (``"compile"``, the default) from the work done
around it on the same thread (``"load"``: a compiled model loaded onto the cores, which
traces again), which ``counts`` leaves out. Listeners (``subscribe``) hear of every job that
starts and ends, on the worker thread: progress lines and metrics are written from there.

The module imports nothing of the compiler: the serving edge and the engines submit closures.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

logger = logging.getLogger("neuron_serve")

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


READY = 0  # what a replica needs before it says ready
NEEDED = 1  # what a request is waiting for
BACKGROUND = 2  # the rest, compiled while the replica serves

PENDING, RUNNING, COMPILED, FAILED, CANCELLED = "pending", "running", "compiled", "failed", "cancelled"
KINDS = ("compile", "load")


@dataclass(eq=False)
class CompileJob:
    """One submitted job: its label, where it stands, its seconds and, when failed, why."""

    label: str
    group: str
    priority: int
    kind: str
    future: Future
    state: str = PENDING
    seconds: float | None = None  # the job's own run time, once it ended
    error: str | None = None  # "ExceptionType: message", when failed
    submitted: float = field(default_factory=time.monotonic)
    _fn: Callable[[], Any] | None = field(default=None, repr=False)
    _sequence: int = 0

    @property
    def done(self) -> bool:
        return self.state in (COMPILED, FAILED, CANCELLED)


@dataclass(frozen=True)
class Counts:
    """Compile jobs (``kind`` "compile") of a group, by state."""

    compiled: int = 0
    pending: int = 0  # waiting, not yet started
    running: int = 0
    failed: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counts as ``status`` and model metadata show them (running counted as pending)."""
        return {"compiled": self.compiled, "pending": self.pending + self.running, "failed": self.failed}


Listener = Callable[[CompileJob], None]


class CompileQueue:
    """Jobs run one at a time on one worker thread (started with the first job), most urgent first."""

    def __init__(self, name: str = "compile-queue") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, CompileJob]] = []
        self._jobs: list[CompileJob] = []
        self._sequence = itertools.count()
        self._listeners: list[Listener] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- submitting and waiting --------------------------------------------------------

    def submit(self, label: str, fn: Callable[[], Any], *, priority: int = BACKGROUND, group: str = "",
               kind: str = "compile") -> CompileJob:
        """Queue ``fn`` (called with no arguments on the worker thread); returns its job, whose
        ``future`` holds what ``fn`` returns or raises. May be called from a job."""
        if kind not in KINDS:
            raise ValueError(f"submit: kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"submit: priority must be an int (READY, NEEDED or BACKGROUND), got {priority!r}")
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed; no job can be submitted")
            job = CompileJob(label, group, priority, kind, Future(), _fn=fn)
            job._sequence = next(self._sequence)
            self._jobs.append(job)
        # Told before the worker can see it: a replica's pending count says so at once, and in order.
        self._tell(job)
        with self._cond:
            heapq.heappush(self._heap, (priority, job._sequence, job))
            self._start()
            self._cond.notify_all()
        return job

    def promote(self, job: CompileJob, priority: int) -> None:
        """Run a pending ``job`` at ``priority`` if that is more urgent (a request waits for it)."""
        with self._cond:
            if job.state == PENDING and priority < job.priority:
                job.priority = priority  # its old heap entry is skipped: its priority no longer matches
                heapq.heappush(self._heap, (priority, job._sequence, job))
                self._cond.notify_all()

    def wait(self, jobs: Iterable[CompileJob], timeout: float | None = None) -> bool:
        """Wait until every one of ``jobs`` has ended (compiled, failed or cancelled); False on timeout.

        Never from a job for a job queued behind it: the worker would wait for itself.
        """
        jobs = list(jobs)
        if threading.current_thread() is self._thread and any(not j.done for j in jobs):
            raise RuntimeError(f"{self.name}: a job cannot wait for another job; the one worker would wait for "
                               "itself. Submit it and return instead.")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not all(j.done for j in jobs):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def on_worker(self) -> bool:
        """Whether the calling thread is the queue's worker (inside a job)."""
        return threading.current_thread() is self._thread

    def cancel(self, group: str) -> int:
        """Drop ``group``'s pending jobs (its replica stops); returns how many. A running one finishes."""
        dropped = []
        with self._cond:
            for job in self._jobs:
                if job.group == group and job.state == PENDING:
                    job.state = CANCELLED
                    dropped.append(job)
            self._cond.notify_all()
        for job in dropped:
            job.future.cancel()
            self._tell(job)
        return len(dropped)

    # -- what it has done ---------------------------------------------------------------

    def jobs(self, group: str | None = None) -> list[CompileJob]:
        """Every job submitted (of ``group``), in submission order."""
        with self._cond:
            return [j for j in self._jobs if group is None or j.group == group]

    def counts(self, group: str | None = None) -> Counts:
        """Compile jobs (not loads) of ``group`` (every group with None), by state."""
        tally = {PENDING: 0, RUNNING: 0, COMPILED: 0, FAILED: 0}
        for job in self.jobs(group):
            if job.kind == "compile" and job.state in tally:
                tally[job.state] += 1
        return Counts(compiled=tally[COMPILED], pending=tally[PENDING], running=tally[RUNNING], failed=tally[FAILED])

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(job)`` when a job is queued (on the submitting thread), starts and ends (on the worker
        thread; a cancelled one on the thread that cancels it); what it raises is logged. Returns the function that
        unsubscribes it."""
        with self._cond:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._cond:
                if listener in self._listeners:
                    self._listeners.remove(listener)
        return unsubscribe

    def group(self, name: str) -> CompileGroup:
        """The jobs of group ``name``, as one model's build submits and reports them."""
        return CompileGroup(self, name)

    def close(self, timeout: float | None = None) -> None:
        """Cancel what is pending, refuse new jobs, and stop the worker once its job ends."""
        with self._cond:
            self._closed = True
            groups = {j.group for j in self._jobs if j.state == PENDING}
        for group in groups:
            self.cancel(group)
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the worker ------------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self._thread.start()

    def _next(self) -> CompileJob | None:
        with self._cond:
            while True:
                while self._heap:
                    priority, _, job = heapq.heappop(self._heap)
                    if job.state == PENDING and priority == job.priority:  # else cancelled, or promoted
                        job.state = RUNNING
                        return job
                if self._closed:
                    return None
                self._cond.wait()

    def _work(self) -> None:
        while (job := self._next()) is not None:
            self._tell(job)
            started = time.perf_counter()
            try:
                result = job._fn()
            except BaseException as exc:  # noqa: BLE001 - recorded and told; the worker goes on
                job.seconds = time.perf_counter() - started
                job.error = f"{type(exc).__name__}: {exc}"
                what = f"compile of {job.label}" if job.kind == "compile" else job.label
                logger.warning("%s failed after %.1f s: %s%s", what, job.seconds, job.error, _whose(exc, job))
                with self._cond:
                    job.state = FAILED
                    job._fn = None
                    self._cond.notify_all()
                job.future.set_exception(exc)
            else:
                job.seconds = time.perf_counter() - started
                with self._cond:
                    job.state = COMPILED
                    job._fn = None
                    self._cond.notify_all()
                job.future.set_result(result)
            release_freed_heap()
            self._tell(job)

    def _tell(self, job: CompileJob) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(job)
            except Exception:  # a listener (metrics, a progress line) must never stop the compiles
                logger.exception("a compile queue listener failed on %s", job.label)


def _whose(exc: BaseException, job: CompileJob) -> str:
    """What a failure means for the replica, when it is torch-xla's own (errors.InternalCompileError), not the
    model's: a start-up model's stops the start; a later one's leaves the replica serving on what it has."""
    if not getattr(exc, "internal", False):
        return ""
    if job.priority == READY:
        return " (an internal failure of torch-xla, not the model: the replica cannot start without this model)"
    return " (an internal failure of torch-xla, not the model: the replica serves on the models it has compiled)"


class CompileGroup:
    """One model's jobs on a queue (a replica builds one model): submitting them, and what it
    reports of them (counts, failures, each job's seconds) and listens to."""

    def __init__(self, queue: CompileQueue, name: str) -> None:
        self.queue = queue
        self.name = name

    def submit(self, label: str, fn: Callable[[], Any], *, priority: int = BACKGROUND,
               kind: str = "compile") -> CompileJob:
        """:meth:`CompileQueue.submit` in this group."""
        return self.queue.submit(label, fn, priority=priority, group=self.name, kind=kind)

    def wait(self, jobs: Iterable[CompileJob], timeout: float | None = None) -> bool:
        return self.queue.wait(jobs, timeout)

    def cancel(self) -> int:
        return self.queue.cancel(self.name)

    def jobs(self) -> list[CompileJob]:
        return self.queue.jobs(self.name)

    def counts(self) -> Counts:
        return self.queue.counts(self.name)

    def failures(self) -> list[tuple[str, str]]:
        """(label, reason) of each compile of the group that failed."""
        return [(j.label, j.error or "") for j in self.jobs() if j.kind == "compile" and j.state == FAILED]

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """:meth:`CompileQueue.subscribe`, told only of this group's jobs."""
        return self.queue.subscribe(lambda job: listener(job) if job.group == self.name else None)


_QUEUE: CompileQueue | None = None
_QUEUE_LOCK = threading.Lock()


def compile_queue() -> CompileQueue:
    """This process's compile queue (one per process: one per replica)."""
    global _QUEUE
    with _QUEUE_LOCK:
        if _QUEUE is None:
            _QUEUE = CompileQueue()
        return _QUEUE
