"""The requests an engine holds, and the one place their state changes after a call: update_from_output.

:class:`RequestStates` owns every request from its submission to its end: it applies what a call
gave (vLLM v1's ``Scheduler.update_from_output``): appends each row's tokens, checks the stop rules
(stopping.py), records a prompt as written (the scheduler's prefix cache holds it), counts accepted
proposals, ends a request (its slot and its adapter's buffer slot given back through the scheduler,
its adapter's count through adapters.py) and queues its events, handed to their sinks by
:meth:`deliver`. It also ends requests aborted, timed out, or failed by the plan.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from .plan import Decode, Mixed, Prefill, PrefillBatch
from ..frontend.protocol import TokenEvent
from .request import Sequence, Status
from .stopping import stop_reason

if TYPE_CHECKING:
    from ..lora.adapters import Adapters
    from .metrics import EngineMetrics
    from .plan import Call
    from ..runner.calls import CallOutput
    from ..sample.sampling import Sampled
    from .scheduler import Scheduler

logger = logging.getLogger("neuron_serve")


class RequestStates:
    """See the module docstring. ``lock`` guards the open requests (submitted and aborted from other threads);
    ``abort`` is the engine's (a request whose sink failed ends at the next step)."""

    def __init__(self, scheduler: Scheduler, metrics: EngineMetrics, eos_token_ids: frozenset[int],
                 max_model_len: int, lock: threading.Lock, abort: Callable[[str], None],
                 adapters: Adapters | None = None, request_timeout_s: float | None = None) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.adapters = adapters
        self.request_timeout_s = request_timeout_s
        self.lock = lock
        self._abort = abort
        self.open: dict[str, Sequence] = {}  # every request submitted and not ended, by id
        # Sequences in submission order: with one timeout for all, the first is the first to expire.
        self._deadlines: deque[Sequence] = deque()
        self._pending: list[tuple[Sequence, TokenEvent]] = []  # events not yet handed to their sinks

    def opened(self, seqs: list[Sequence]) -> None:
        """Requests that arrived (already in ``open``): queued for the scheduler, and their deadlines."""
        for seq in seqs:
            self.scheduler.add(seq)
        if self.request_timeout_s is not None:
            self._deadlines.extend(seqs)

    def rows(self, ids: tuple[str, ...]) -> list[Sequence]:
        """The requests of a call's rows, but those that ended earlier in the step."""
        return [seq for rid in ids if (seq := self.open.get(rid)) is not None and not seq.finished]

    # -- the ends a step applies before its plan ---------------------------------------------

    def abort(self, aborted: dict[str, str]) -> None:
        for rid, reason in aborted.items():
            seq = self.open.get(rid)
            if seq is not None:
                self.finish(seq, reason)

    def fail(self, failed: list[tuple[str, str]]) -> None:
        for rid, error in failed:
            self.finish(self.open[rid], "error", error=error)

    def expire(self) -> None:
        """Abort the sequences past ``request_timeout_s`` (waiting or running): their slots go back now."""
        if self.request_timeout_s is None:  # no limit (any more): nothing expires
            self._deadlines.clear()
            return
        limit = time.perf_counter() - self.request_timeout_s
        while self._deadlines and (self._deadlines[0].finished or self._deadlines[0].arrival <= limit):
            seq = self._deadlines.popleft()  # ended (nothing to do, just forgotten) or expired
            if not seq.finished:
                self.finish(seq, "abort", error=f"the request timed out: it was not finished "
                                                f"{self.request_timeout_s:g}s after it arrived (request_timeout_s); "
                                                f"ask for fewer tokens or retry later", timed_out=True)

    # -- a call's output ---------------------------------------------------------------------

    def update_from_output(self, call: Call, rows: list[Sequence], output: CallOutput) -> bool:
        """Apply what ``call`` over ``rows`` gave; True when it gave a prompt its first token (which goes out at
        once: left for the next call to carry, it would wait for the decode step to be prepared and launched, or
        for the whole decode step when the prefill's own step runs one: the LLM example's first token, 8.8 against
        5.2 ms in process, 18.4 against 12.3 ms served)."""
        if isinstance(call, PrefillBatch):
            for seq, tokens in zip(rows, output.tokens):
                self.scheduler.wrote(seq, len(seq.prompt))
                self.append(seq, tokens[0])
                self._prefilled(seq)
            return True
        if isinstance(call, Prefill):
            [seq] = rows
            self.scheduler.wrote(seq, len(seq.prompt))
            if output.prompt_logprobs is not None:
                seq.prompt_logprobs = output.prompt_logprobs
            if output.tokens[0]:
                self.append(seq, output.tokens[0][0])
            else:  # the prompt's logprobs were all it asked for
                self.finish(seq, "length")
            self._prefilled(seq)
            return True
        if isinstance(call, Mixed):
            *running, seq = rows
            self.scheduler.wrote(seq, call.chunk.start + call.chunk.length)
            for row, tokens in zip(running, output.tokens):
                self.append(row, tokens[0])
            if call.chunk.last:
                self.append(seq, output.tokens[-1][0])
                self._prefilled(seq)
            return call.chunk.last
        assert isinstance(call, Decode)
        for i, (seq, tokens) in enumerate(zip(rows, output.tokens)):
            if output.proposals is not None and output.proposals[i]:
                self.metrics.speculated(output.proposals[i], [t.token for t in tokens])
            for sampled in tokens:  # the tokens after its end were computed for nothing
                self.append(seq, sampled)
                if seq.finished:
                    break
        return False

    def _prefilled(self, seq: Sequence) -> None:
        """``seq``'s whole prompt is in its slot and its first token out."""
        self.metrics.count(self.metrics.prompt_tokens, len(seq.prompt))
        if self.scheduler.prefix is not None:
            self.metrics.count(self.metrics.prefix_queries, len(seq.prompt))
            self.metrics.count(self.metrics.prefix_hits, seq.cached)

    def append(self, seq: Sequence, sampled: Sampled) -> None:
        """``seq`` takes a token: its event queued, or it ends with it."""
        if seq.constraint is not None and not seq.constraint.accept(sampled.token):
            self.finish(seq, "error", error=f"token {sampled.token} left the structured output's grammar")
            return
        now = time.perf_counter()
        seq.output.append(sampled.token)
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.observe(self.metrics.ttft, now - seq.arrival)
        else:
            self.metrics.token_gap(now - seq.last_token_at)
        seq.last_token_at = now
        self.metrics.count(self.metrics.generation_tokens)
        reason, stop = stop_reason(seq, sampled.token, self.eos_token_ids, self.max_model_len)
        event = TokenEvent(seq.request_id, sampled.token, sampled.logprob, sampled.top, prompt_tokens=len(seq.prompt),
                           completion_tokens=len(seq.output))
        if seq.prompt_logprobs is not None:  # on the first event only
            event.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        if reason is None:
            self._pending.append((seq, event))
            return
        self.finish(seq, reason, stop, event)

    def finish(self, seq: Sequence, reason: str, stop: int | str | None = None, event: TokenEvent | None = None,
               error: str | None = None, timed_out: bool = False) -> None:
        """End ``seq`` with ``reason``: its slot (keeping what it wrote, unless a call failed), its adapter's buffer
        slot and its adapter's count given back; its last event queued."""
        self.scheduler.release(seq, intact=error is None or timed_out)
        with self.lock:
            self.open.pop(seq.request_id, None)
        if seq.adapter is not None and self.adapters is not None:
            self.adapters.done(seq.adapter)
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop
        event = event or TokenEvent(seq.request_id, None, prompt_tokens=len(seq.prompt),
                                    completion_tokens=len(seq.output), prompt_logprobs=seq.prompt_logprobs)
        event.finish_reason, event.stop_reason, event.error, event.timed_out = reason, stop, error, timed_out
        self.metrics.count(self.metrics.finished(reason))
        self.metrics.observe(self.metrics.e2e, time.perf_counter() - seq.arrival)
        self._pending.append((seq, event))

    def fail_running(self, exc: Exception) -> None:
        """A call failed: its sequences fail, never the engine."""
        for seq in [*self.scheduler.running.values()]:
            self.finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

    # -- events out --------------------------------------------------------------------------

    def deliver(self) -> None:
        """Hand every queued event to its request's sink, in order; a sink that fails aborts its request, never the
        engine. The step's metrics are applied first, so a request that has its last event is already counted."""
        self.metrics.flush()
        pending, self._pending = self._pending, []
        for seq, event in pending:
            try:
                seq.sink(event)
            except Exception:  # noqa: BLE001 - the sink is the caller's code
                logger.exception("generate request %s: its event sink failed; aborting it", seq.request_id)
                if not event.finished:
                    self._abort(seq.request_id)
