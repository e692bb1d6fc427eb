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

import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..errors import HostMemoryExceeded
from . import host_memory

logger = logging.getLogger("neuron_serve")

DEFERRED_RECHECK_S = 2.0  # how often a compile put off for want of host memory looks again, at the least

READY = 0  # what a replica needs before it says ready
NEEDED = 1  # what a request is waiting for
BACKGROUND = 2  # the rest, compiled while the replica serves

PENDING, RUNNING, COMPILED, FAILED, CANCELLED = "pending", "running", "compiled", "failed", "cancelled"
KINDS = ("compile", "load")


@dataclass(eq=False)
class CompileJob:
    """One submitted job: its label, where it stands, its seconds and, when failed, why; the host memory it took
    at its peak and kept (host_memory.py)."""

    label: str
    group: str
    priority: int
    kind: str
    future: Future
    family: str = ""  # the compiles alike in the memory they need (a model's prefills, its decodes, a load)
    state: str = PENDING
    seconds: float | None = None  # the job's own run time, once it ended
    error: str | None = None  # "ExceptionType: message", when failed
    submitted: float = field(default_factory=time.monotonic)
    peak_bytes: int | None = None  # above the resident set it started from, at its peak
    kept_bytes: int | None = None  # resident set it added, once ended (a compiled model's code and bookkeeping)
    deferred: float | None = None  # when it was first put off for want of host memory
    _fn: Callable[[], Any] | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)  # why it was skipped
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
        self.budget = host_memory.Budget()  # each family's need, against the room the machine has
        self._deferred: list[CompileJob] = []  # put off for want of host memory, in submission order

    # -- submitting and waiting --------------------------------------------------------

    def submit(self, label: str, fn: Callable[[], Any], *, priority: int = BACKGROUND, group: str = "",
               kind: str = "compile", family: str | None = None) -> CompileJob:
        """Queue ``fn`` (called with no arguments on the worker thread); returns its job, whose
        ``future`` holds what ``fn`` returns or raises. May be called from a job. ``family`` groups the jobs
        whose host memory needs are alike (default: the group and kind)."""
        if kind not in KINDS:
            raise ValueError(f"submit: kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"submit: priority must be an int (READY, NEEDED or BACKGROUND), got {priority!r}")
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed; no job can be submitted")
            job = CompileJob(label, group, priority, kind, Future(), family=family or f"{group} {kind}", _fn=fn)
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
        """The most urgent job whose host memory fits (host_memory.Budget), or None once closed; a job that does
        not fit waits beside the queue, and is skipped once it has waited long enough."""
        while True:
            skipped: list[CompileJob] = []
            with self._cond:
                while not skipped:
                    self._requeue_deferred(skipped)
                    while self._heap and not skipped:
                        priority, _, job = heapq.heappop(self._heap)
                        if job.state != PENDING or priority != job.priority:  # cancelled, or promoted
                            continue
                        if not self._fits(job):
                            self._deferred.append(job)
                            continue
                        job.state = RUNNING
                        return job
                    if self._closed:
                        return None
                    if not skipped:
                        # Deferred jobs are looked at again when memory may have been freed: as a job is submitted
                        # or ends (notify), and every few seconds (another process may have given some back).
                        self._cond.wait(DEFERRED_RECHECK_S if self._deferred else None)
            for job in skipped:  # told outside the lock, as a failed job is
                job.future.set_exception(job._error)
                self._tell(job)

    def _fits(self, job: CompileJob) -> bool:
        """Whether ``job`` may start: it fits the host memory left, or nothing says how much it needs."""
        fits, need, left = self.budget.fits(job.family)
        if fits:
            return True
        if job.deferred is None:
            job.deferred = time.monotonic()
            logger.warning("%s deferred: it needs about %s of host memory at its peak (measured on %s) and %s is "
                           "left (%s); it waits up to %.0f s while the rest run", _what(job),
                           host_memory.gib(need), job.family, host_memory.gib(left.bytes), left.limit,
                           host_memory.wait_seconds())
        return False

    def _requeue_deferred(self, skipped: list[CompileJob]) -> None:
        """Deferred jobs that fit now go back on the queue; those that waited long enough are skipped (under the
        lock; their futures are settled by the caller)."""
        waiting, self._deferred = self._deferred, []
        for job in waiting:
            if job.state != PENDING:
                continue
            fits, need, left = self.budget.fits(job.family)
            if fits:
                logger.info("%s: host memory is free for it now; queued again", _what(job))
                heapq.heappush(self._heap, (job.priority, job._sequence, job))
            elif time.monotonic() - job.deferred >= host_memory.wait_seconds():
                message = (f"{_what(job)} skipped: it needs about {host_memory.gib(need)} of host memory and "
                           f"{host_memory.gib(left.bytes)} is left ({left.limit}) after "
                           f"{time.monotonic() - job.deferred:.0f} s")
                logger.warning("%s; the replica serves on the models it has", message)
                job.state, job.error = FAILED, f"HostMemoryExceeded: {message}"
                job._error, job._fn = HostMemoryExceeded(message), None
                skipped.append(job)
            else:
                self._deferred.append(job)
        if skipped:
            self._cond.notify_all()

    def _work(self) -> None:
        while (job := self._next()) is not None:
            self._tell(job)
            started = time.perf_counter()
            with self.budget.measure(job.family) as measured:
                try:
                    result, error = job._fn(), None
                except BaseException as exc:  # noqa: BLE001 - recorded and told; the worker goes on
                    result, error = None, exc
                job.seconds = time.perf_counter() - started
            job.peak_bytes, job.kept_bytes = measured.peak, measured.kept
            if error is not None:
                job.error = f"{type(error).__name__}: {error}"
                logger.warning("%s failed after %.1f s: %s%s", _what(job), job.seconds, job.error, _whose(error, job))
            with self._cond:
                job.state = COMPILED if error is None else FAILED
                job._fn = None
                self._cond.notify_all()
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)
            self._tell(job)

    def _tell(self, job: CompileJob) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(job)
            except Exception:  # a listener (metrics, a progress line) must never stop the compiles
                logger.exception("a compile queue listener failed on %s", job.label)


def _what(job: CompileJob) -> str:
    return f"compile of {job.label}" if job.kind == "compile" else job.label


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
               kind: str = "compile", family: str | None = None) -> CompileJob:
        """:meth:`CompileQueue.submit` in this group."""
        return self.queue.submit(label, fn, priority=priority, group=self.name, kind=kind, family=family)

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
