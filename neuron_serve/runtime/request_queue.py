"""DynamicBatcher: groups concurrent requests into batches, with a queue bound and deadlines.

One background task forms batches on a single asyncio event loop:

1. It waits for a free batch slot (at most ``max_concurrent_batches`` run at once), so a
   batch keeps filling while every core is busy instead of waiting, half-formed, for one.
2. It takes waiting requests from the front of the queue while their rows fit in
   ``max_batch_size``. A request with more rows than that runs in a batch of its own.
3. It dispatches at once when the batch cannot grow (its rows reach ``max_batch_size`` or
   the largest preferred batch size, or the next request does not fit) or when no batch
   is running; otherwise when ``max_queue_delay_s`` has passed since the first request of
   the batch arrived. Waiting only pays while batches run: then more requests arrive
   while it waits and a core would be busy anyway. On an idle replica it is pure latency,
   so a lone request (concurrency 1) never waits for company that is not coming. Such a
   request runs in its caller's task, not handed to the background task and back
   (``lone.skips_queue``).

Requests that time out while queued leave the queue and never run; a request that times
out after its batch started has its result discarded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from ..errors import ConfigError, InvalidInput, Overloaded, RequestTimeout
from . import lone
from .observer import RuntimeObserver

logger = logging.getLogger("neuron_serve")

RunBatch = Callable[[list[Any]], Awaitable[list[Any]]]


@dataclass(eq=False)
class _Pending:
    """One submitted request; identity-compared so ``deque.remove`` finds exactly this one."""

    item: Any
    rows: int
    arrived: float
    future: asyncio.Future = field(repr=False)
    started: bool = False


def _check_config(
    max_batch_size: int,
    max_queue_delay_s: float,
    max_queue_size: int,
    request_timeout_s: float | None,
    preferred_batch_sizes: Sequence[int] | None,
    max_concurrent_batches: int,
) -> None:
    """Raise ConfigError naming the first invalid parameter and the accepted range."""
    checks = [
        ("max_batch_size", max_batch_size, max_batch_size >= 1, "an integer >= 1"),
        ("max_queue_delay_s", max_queue_delay_s, max_queue_delay_s >= 0, "a number of seconds >= 0"),
        ("max_queue_size", max_queue_size, max_queue_size >= 1, "an integer >= 1"),
        ("request_timeout_s", request_timeout_s, request_timeout_s is None or request_timeout_s > 0,
         "None (no deadline) or a number of seconds > 0"),
        ("max_concurrent_batches", max_concurrent_batches, max_concurrent_batches >= 1, "an integer >= 1"),
        ("preferred_batch_sizes", preferred_batch_sizes,
         preferred_batch_sizes is None or all(s >= 1 for s in preferred_batch_sizes), "None or integers >= 1"),
    ]
    for name, value, ok, expected in checks:
        if not ok:
            raise ConfigError(f"DynamicBatcher: {name}={value!r} is invalid; it must be {expected}.")


class DynamicBatcher:
    """Batches ``submit``-ted items and runs them through ``run_batch``.

    ``run_batch(items)`` returns one result per item, in order; an ``Exception`` instance in
    its place fails only that item. An exception raised by ``run_batch`` fails every item of
    the batch. ``observer.batch(batch_rows, queue_waits)``, with an observer, is called as
    each batch starts, with every item's seconds from submit to the batch start (for metrics).
    """

    def __init__(
        self,
        run_batch: RunBatch,
        *,
        max_batch_size: int,
        max_queue_delay_s: float,
        max_queue_size: int,
        request_timeout_s: float | None,
        preferred_batch_sizes: Sequence[int] | None = None,
        max_concurrent_batches: int = 1,
        observer: RuntimeObserver | None = None,
    ) -> None:
        _check_config(max_batch_size, max_queue_delay_s, max_queue_size, request_timeout_s,
                      preferred_batch_sizes, max_concurrent_batches)
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self.request_timeout_s = request_timeout_s
        self.max_concurrent_batches = max_concurrent_batches
        self.observer = observer
        # Past the largest preferred (compiled) size a batch would only grow by padding
        # into a chunked run, so reaching it is as good as reaching max_batch_size.
        fitting = [s for s in (preferred_batch_sizes or []) if s <= max_batch_size]
        self._full_rows = max(fitting) if fitting else max_batch_size
        self._queue: collections.deque[_Pending] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop_task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._accepting = False
        self._closing = False
        self._counts = {"completed": 0, "failed": 0, "rejected": 0, "timed_out": 0}

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start forming batches; call from inside the running event loop."""
        if self._loop_task is not None:
            return
        # Created here, not in __init__, so they bind to the loop that serves requests.
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(self.max_concurrent_batches)
        self._accepting = True
        self._loop_task = asyncio.get_running_loop().create_task(self._form_batches())

    async def stop(self, drain: bool = True) -> None:
        """Stop accepting; run what is queued (``drain``) or fail it with Overloaded; await running batches."""
        self._accepting = False
        self._closing = True
        if not drain:
            while self._queue:
                self._fail(self._queue.popleft(), Overloaded("server shutting down; request was not run"))
        if self._wakeup is not None:
            self._wakeup.set()
        if self._loop_task is not None:
            await self._loop_task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def __aenter__(self) -> DynamicBatcher:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(drain=True)

    @property
    def stats(self) -> dict[str, int]:
        """Requests queued and batches running now; request counts so far.

        ``completed`` got a result, ``failed`` an error (from run_batch or shutdown),
        ``rejected`` were refused by submit (queue full, shutting down), ``timed_out``
        hit ``request_timeout_s``.
        """
        return {"queued": len(self._queue), "running_batches": len(self._running), **self._counts}

    # -- requests --------------------------------------------------------------------

    def admit(self) -> None:
        """Raise Overloaded now if ``submit`` would refuse for lack of room.

        Lets a server refuse before it reads and decodes a request body, so a burst
        past the queue bound costs next to nothing.
        """
        if self._loop_task is not None and not self._accepting:
            self._counts["rejected"] += 1
            raise Overloaded("server shutting down; not accepting new requests")
        if len(self._queue) >= self.max_queue_size:
            self._counts["rejected"] += 1
            raise Overloaded(f"queue full ({len(self._queue)} requests waiting); retry later")

    async def submit(self, item: Any, rows: int = 1) -> Any:
        """Queue ``item`` (``rows`` rows) for the next batch and return its result.

        Raises Overloaded when the queue is full or the batcher is shutting down, and
        RequestTimeout when ``request_timeout_s`` passes before the result arrives.
        """
        if self._loop_task is None and not self._closing:
            raise RuntimeError("DynamicBatcher.start() must be called before submit().")
        if not self._accepting:
            self._counts["rejected"] += 1
            raise Overloaded("server shutting down; not accepting new requests")
        if rows < 1:
            raise InvalidInput(f"a request needs at least 1 row, got rows={rows}.")
        if len(self._queue) >= self.max_queue_size:
            self._counts["rejected"] += 1
            raise Overloaded(f"queue full ({len(self._queue)} requests waiting); retry later")
        loop = asyncio.get_running_loop()
        pending = _Pending(item, rows, loop.time(), loop.create_future())
        if lone.skips_queue(len(self._queue), len(self._running), not self._slots.locked()):
            return await self._run_alone(pending)
        self._queue.append(pending)
        self._wakeup.set()
        try:
            done, _ = await asyncio.wait({pending.future}, timeout=self.request_timeout_s)
        except BaseException:
            self._abandon(pending)  # the caller went away (cancelled): same as a timeout
            raise
        if not done:
            self._abandon(pending)
            self._counts["timed_out"] += 1
            raise RequestTimeout(
                f"request timed out after waiting {self.request_timeout_s:g}s "
                f"({'running' if pending.started else 'still queued'}); raise request_timeout_s or retry later"
            )
        return pending.future.result()

    async def _run_alone(self, pending: _Pending) -> Any:
        """Run a request that finds the batcher idle as a batch of its own, in the caller's task.

        It is what the batching task would do at once (nothing runs, so nothing is worth
        waiting for), without the three turns of the event loop that handing it to that
        task and back costs. It counts as a running batch, so requests arriving meanwhile
        queue and batch behind it as behind any other.
        """
        await self._slots.acquire()  # free (checked by the caller): returns without waiting
        pending.started = True
        loop = asyncio.get_running_loop()
        running = loop.create_future()  # what stop() awaits
        self._running.add(running)
        # The deadline cancels this task, as asyncio.timeout (Python 3.11+) would.
        task, expired = asyncio.current_task(), []
        timer = None if self.request_timeout_s is None else loop.call_later(
            self.request_timeout_s, lambda: expired.append(task.cancel()))
        try:
            await self._run([pending])
        except asyncio.CancelledError:
            if not expired:
                raise
            if hasattr(task, "uncancel"):
                task.uncancel()
            self._counts["timed_out"] += 1
            raise RequestTimeout(
                f"request timed out after waiting {self.request_timeout_s:g}s (running); "
                f"raise request_timeout_s or retry later"
            ) from None
        finally:
            if timer is not None:
                timer.cancel()
            if pending.future.done() and not pending.future.cancelled():
                pending.future.exception()  # retrieved here when the caller will not (timed out, cancelled)
            self._running.discard(running)
            running.set_result(None)
            self._slots.release()
        return pending.future.result()

    def _abandon(self, pending: _Pending) -> None:
        """Make sure an abandoned request never runs (if queued) and its result is dropped."""
        if not pending.started:
            try:
                self._queue.remove(pending)
            except ValueError:
                pass  # already taken off by stop(drain=False) or a batcher failure
        pending.future.cancel()

    # -- batch formation ----------------------------------------------------------------

    def _fit(self) -> tuple[int, bool]:
        """How many requests from the queue front form the next batch, and whether it is full."""
        count, rows = 0, 0
        for pending in self._queue:
            if count and rows + pending.rows > self.max_batch_size:
                return count, True  # the next request does not fit: waiting cannot help
            count, rows = count + 1, rows + pending.rows
            if rows >= self._full_rows:
                return count, True
        return count, False

    async def _next_batch(self) -> list[_Pending] | None:
        """Wait until a batch is due and take it off the queue; None once closing and empty."""
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            if not self._queue:
                if self._closing:
                    return None
                await self._wakeup.wait()
                continue
            count, full = self._fit()
            # Recomputed each pass: the first request may have timed out and left the queue.
            remaining = self._queue[0].arrived + self.max_queue_delay_s - loop.time()
            if full or remaining <= 0 or self._closing or not self._running:
                batch = [self._queue.popleft() for _ in range(count)]
                for pending in batch:
                    pending.started = True
                return batch
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def _form_batches(self) -> None:
        """The background task: take a slot, form a batch, hand it to a runner task."""
        try:
            while True:
                await self._slots.acquire()
                batch = await self._next_batch()
                if batch is None:
                    self._slots.release()
                    return
                task = asyncio.get_running_loop().create_task(self._run(batch))
                self._running.add(task)
                task.add_done_callback(self._batch_done)
        except BaseException as exc:
            # Never leave callers hanging on a batcher that can no longer form batches
            # (cancelled with its event loop, or broken by a bug).
            if not isinstance(exc, asyncio.CancelledError):
                logger.exception("DynamicBatcher stopped forming batches")
            self._accepting = False
            while self._queue:
                self._fail(self._queue.popleft(), Overloaded("batcher stopped; request was not run"))
            raise

    def _batch_done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._slots.release()

    async def _run(self, batch: list[_Pending]) -> None:
        """Run one batch and deliver each item's result or error."""
        # Requests abandoned between dispatch and now are dropped before they run.
        live = [p for p in batch if not p.future.done()]
        if not live:
            return
        self._report(live)
        try:
            results = await self._run_batch([p.item for p in live])
            if not isinstance(results, (list, tuple)) or len(results) != len(live):
                got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
                raise RuntimeError(f"run_batch returned {got} for {len(live)} items; it must return one per item.")
        except asyncio.CancelledError:
            # Cancelling a caller's future would surface as a bare CancelledError in its
            # task; a typed error says what happened.
            for pending in live:
                self._fail(pending, Overloaded("batch was cancelled before it finished; retry later"))
            raise
        except Exception as exc:
            for pending in live:
                self._fail(pending, exc)
            return
        for pending, result in zip(live, results):
            if isinstance(result, Exception):
                self._fail(pending, result)
            elif not pending.future.done():
                pending.future.set_result(result)
                self._counts["completed"] += 1

    def _fail(self, pending: _Pending, exc: BaseException) -> None:
        if not pending.future.done():
            pending.future.set_exception(exc)
            self._counts["failed"] += 1

    def _report(self, live: list[_Pending]) -> None:
        """Tell the observer the batch's rows and queue waits; a broken observer must not break serving."""
        if self.observer is None:
            return
        now = asyncio.get_running_loop().time()
        try:
            self.observer.batch(sum(p.rows for p in live), [now - p.arrived for p in live])
        except Exception:
            logger.exception("DynamicBatcher: the observer's batch() failed")
