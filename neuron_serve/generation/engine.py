"""The generation engine: a thread that steps the scheduler over one compiled model and its cache.

The engine speaks tokens. :meth:`Engine.generate` takes prompt token ids and
:class:`~neuron_serve.generation.sampling.SamplingParams` and is an async stream of
:class:`TokenEvent` (one per new token; the last says why the sequence ended);
:meth:`Engine.abort` ends a request by id (its slot is free at the next step).
:meth:`Engine.generate_batch` is the same for a list of prompts from plain Python,
without an event loop or Ray. Text, chat templates and wire formats live at the
serving edge.

One thread drives the core (torch-xla replays an executable on the calling thread's
device): each step aborts what was aborted, prefills admitted prompts one by one,
then decodes every running sequence in one call, samples, and hands each request
its new token (with ``decode_steps``, the call runs that many greedy steps while every
running sequence is greedy, and each gets its tokens up to its end). A step's events
reach their requests while the next step's first model call computes
(:func:`~neuron_serve.compile.subgraph.while_computing`): the event loop that streams
them then holds the GIL while the core works, not while the engine prepares the call.
Between steps it sleeps while nothing is waiting or running.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence as Seq

from ..compile.subgraph import take_meanwhile, while_computing
from ..errors import InvalidInput, Overloaded
from ..targets.pjrt import use_device
from .mailbox import Mailbox
from .metrics import EngineMetrics
from .model import GenerationModel, StepOutput
from .sampling import SamplingParams, Sampled, generator_for, sample_row
from .scheduler import Scheduler, Sequence, default_budget
from .text import IncrementalText

logger = logging.getLogger("neuron_serve")

DEFAULT_MAX_WAITING = 256


@dataclass
class TokenEvent:
    """One new token of a request (or its end): what the serving edge streams."""

    request_id: str
    token: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" on the last event
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    text: str | None = None  # with stop strings: the output text, cut before the stop string (last event)
    timed_out: bool = False  # an abort because the request ran past the engine's request_timeout_s (last event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    """A whole request's result, as :meth:`Engine.generate_batch` returns it."""

    request_id: str
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[float | None] = field(default_factory=list)
    text: str | None = None


def check_prompt(prompt: Seq[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                 has_tokenizer: bool) -> list[int]:
    """The prompt's token ids, or InvalidInput saying what is wrong with the request."""
    if not isinstance(params, SamplingParams):
        raise InvalidInput("params must be a neuron_serve.generation.SamplingParams.")
    ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidInput("the prompt is empty; give at least one token.")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidInput(f"prompt token id {bad[0]} is outside the vocabulary (0 to {vocab_size - 1}).")
    limit = max_model_len
    if len(ids) >= limit:
        raise InvalidInput(f"the prompt has {len(ids)} tokens, max_model_len is {limit}: no room for a generated "
                           f"token. Shorten the prompt.")
    if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
        raise InvalidInput(f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                           f"{len(ids) + params.max_tokens} tokens, more than max_model_len ({limit}). Shorten "
                           f"the prompt or lower max_tokens.")
    if params.stop and not has_tokenizer:
        raise InvalidInput("stop strings need a tokenizer; this engine has none (give stop_token_ids instead).")
    return ids


def _plain_greedy(seq: Sequence) -> bool:
    """Whether the core's argmax is the sequence's whole choice (no sampling, penalties or logprobs)."""
    return seq.params.greedy and seq.params.logprobs is None and not seq.params.penalized


class Streams(abc.ABC):
    """The async and batch APIs over ``submit`` and ``abort`` (an engine's, or a group's)."""

    @abc.abstractmethod
    def submit(self, prompt: Seq[int], params: SamplingParams, sink: Callable[[TokenEvent], None],
               request_id: str | None = None) -> str:
        """Queue a request; ``sink`` gets its events on an engine thread. Returns the request id."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """End a request: it gets a last event with finish_reason "abort"; its slot is free at the next step."""

    def _mailbox(self) -> Mailbox:
        """The running loop's mailbox, shared by every stream this object serves on it."""
        loop = asyncio.get_running_loop()
        boxes = getattr(self, "_mailboxes", None)
        if boxes is None:
            boxes = self._mailboxes = weakref.WeakKeyDictionary()
        found = boxes.get(loop)
        if found is None:
            found = boxes[loop] = Mailbox(loop)
        return found

    async def generate(self, prompt: Seq[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        """An async stream of the request's events; leaving the stream early aborts the request."""
        mailbox = self._mailbox()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:
            mailbox.post(queue.put_nowait, event)  # one wake-up of the loop for a step's events

        rid = self.submit(prompt, params, sink, request_id)
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finished
                yield event
        finally:
            if not finished:
                self.abort(rid)

    def generate_batch(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                       timeout: float | None = None) -> list[Completion]:
        """Generate for every prompt at once (continuous batching) and wait; results in prompt order."""
        every = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        done = threading.Semaphore(0)
        results: list[Completion | None] = [None] * len(prompts)

        def collect(index: int, prompt: list[int]) -> Callable[[TokenEvent], None]:
            tokens: list[int] = []
            logprobs: list[float | None] = []

            def sink(event: TokenEvent) -> None:
                if event.token is not None:
                    tokens.append(event.token)
                    logprobs.append(event.logprob)
                if event.finished:
                    results[index] = Completion(event.request_id, prompt, tokens, event.finish_reason,
                                                event.stop_reason, logprobs, event.text)
                    done.release()
            return sink

        ids = [self.submit(prompt, p, collect(i, list(prompt))) for i, (prompt, p) in enumerate(zip(prompts, every))]
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in prompts:
            if not done.acquire(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
                for rid, result in zip(ids, results):
                    if result is None:  # nobody waits for it any more: its slot goes back
                        self.abort(rid)
                raise TimeoutError(f"generate_batch: not finished within {timeout}s; the unfinished requests "
                                   f"were aborted")
        return [r for r in results if r is not None]


class Engine(Streams):
    """Continuous batching over ``model``'s KV-cache slots; see the module docstring.

    ``eos_token_ids`` end a sequence (unless its ``ignore_eos``); ``tokenizer`` (a
    transformers tokenizer) is needed only for stop strings. ``max_num_batched_tokens``
    bounds the prompt tokens prefilled per step, ``max_waiting`` the queue. A request
    still waiting or running ``request_timeout_s`` after it was submitted is aborted
    (its last event says ``timed_out``) and its slot is free at the next step.
    """

    def __init__(self, model: GenerationModel, *, eos_token_ids: Seq[int] = (), tokenizer: Any = None,
                 max_num_batched_tokens: int | None = None, max_waiting: int = DEFAULT_MAX_WAITING,
                 request_timeout_s: float | None = None, name: str = "model", replica: str = "0",
                 device: Any = None) -> None:
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise InvalidInput(f"request_timeout_s must be a number of seconds > 0 (or None: no limit); got "
                               f"{request_timeout_s!r}.")
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.name = name
        budget = max_num_batched_tokens or default_budget(model.max_model_len)
        self.scheduler = Scheduler(model.slots, budget)
        self.max_waiting = max_waiting
        self.request_timeout_s = request_timeout_s
        # Sequences in submission order: with one timeout for all, the first is the first to expire.
        self._deadlines: deque[Sequence] = deque()
        self.metrics = EngineMetrics(name, replica)
        self.device = device
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._by_id: dict[str, Sequence] = {}
        self._pending: list[tuple[Sequence, TokenEvent]] = []  # events not yet handed to their sinks
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # -- the API ------------------------------------------------------------------------

    def submit(self, prompt: Seq[int], params: SamplingParams, sink: Callable[[TokenEvent], None],
               request_id: str | None = None) -> str:
        """Queue a request; ``sink`` gets its events on the engine's thread. Returns the request id."""
        prompt = self._check_prompt(prompt, params)
        with self._lock:
            if self._stopping:
                raise Overloaded("the generation engine is stopping; retry on another replica.")
            waiting = len(self.scheduler.waiting) + len(self._inbox)
            if waiting >= self.max_waiting:
                raise Overloaded(f"the generation queue is full ({waiting} requests waiting); retry later.")
            rid = request_id if request_id is not None else f"gen-{next(self._ids)}"
            if rid in self._by_id:
                raise InvalidInput(f"request id {rid!r} is already running; give each request its own id.")
            seq = Sequence(rid, prompt, params, sink, generator=generator_for(params),
                           text=IncrementalText(self.tokenizer, params.stop) if params.stop else None)
            self._by_id[rid] = seq
            self._inbox.append(seq)
            self._wake.notify()
        return rid

    def abort(self, request_id: str) -> None:
        """End a request: it gets a last event with finish_reason "abort"; its slot is free at the next step."""
        with self._lock:
            if request_id in self._by_id:
                self._aborts.add(request_id)
                self._wake.notify()

    @property
    def running(self) -> int:
        """Sequences holding a slot."""
        return len(self.scheduler.running)

    @property
    def free_slots(self) -> int:
        """Slots not held nor promised to a waiting request (negative when requests wait)."""
        with self._lock:
            return len(self.scheduler.free) - len(self.scheduler.waiting) - len(self._inbox)

    def close(self) -> None:
        """Stop the engine thread; requests still queued or running end with finish_reason "abort"."""
        with self._lock:
            self._stopping = True
            self._aborts.update(self._by_id)
            self._wake.notify()
        self._thread.join(timeout=30)

    # -- checks ---------------------------------------------------------------------------

    def _check_prompt(self, prompt: Seq[int], params: SamplingParams) -> list[int]:
        return check_prompt(prompt, params, vocab_size=self.model.vocab_size, max_model_len=self.model.max_model_len,
                            has_tokenizer=self.tokenizer is not None)

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        if self.device is not None:
            use_device(self.device)
        # Compile the slot move now, not in the middle of the first step that needs one
        # (slot 0 over itself: the cache is empty and stays so).
        self.model.move(0, 0)
        while True:
            if self.scheduler.idle:  # no model call is coming to carry them
                take_meanwhile()  # left set when a failed step never launched its call
                self._deliver()
            with self._lock:
                while not self._inbox and not self._aborts and self.scheduler.idle and not self._stopping:
                    self._wake.wait()
                if self._stopping and self.scheduler.idle and not self._inbox and not self._aborts:
                    return
                arrived, self._inbox = self._inbox, []
                aborted, self._aborts = self._aborts, set()
            for seq in arrived:
                self.scheduler.add(seq)
            if self.request_timeout_s is not None:
                self._deadlines.extend(arrived)
            try:
                self.step(aborted)
            except Exception as exc:  # a failed call fails its sequences, never the engine
                logger.exception("generation step failed")
                for seq in [*self.scheduler.running.values()]:
                    self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

    def step(self, aborted: set[str] = frozenset()) -> None:
        """One iteration: aborts, prefills under the token budget, one decode call for every running sequence.

        The events of the step before are delivered while this step's first model call
        computes, or at its end if it makes none; a prefill's first token right after it."""
        if self._pending or self.metrics.queued:
            while_computing(self._deliver)
        for rid in aborted:
            seq = self._by_id.get(rid)
            if seq is not None:
                self._finish(seq, "abort")
        if self._deadlines:
            self._expire()
        self._prefill()
        for seq, slot in self.scheduler.compaction(self.model.rows_bucket):
            self.model.move(seq.slot, slot)
            self.scheduler.move(seq, slot)
        running = self.scheduler.decoding()
        if running:
            steps = self._steps(running)
            started = time.perf_counter()
            out, shape = self.model.decode([s.output[-1] for s in running], [s.position for s in running],
                                           [s.slot for s in running], steps)
            self.metrics.observe(self.metrics.step(shape), time.perf_counter() - started)
            if steps == 1:
                self._choose(running, out)
            else:
                for seq, tokens in zip(running, out.greedy):
                    for token in tokens:  # the tokens after its end were computed for nothing
                        self._append(seq, Sampled(token))
                        if seq.finish_reason is not None:
                            break
        self._gauges()
        if take_meanwhile() is not None:  # no model call this step carried them
            self._deliver()

    def _prefill(self) -> None:
        """Prefill the prompts the scheduler admits, each into its slot; each first token goes out at once."""
        for seq in self.scheduler.admit():
            started = time.perf_counter()
            out, shape = self.model.prefill(seq.prompt, seq.slot)
            self.metrics.observe(self.metrics.step(shape), time.perf_counter() - started)
            self.metrics.count(self.metrics.prompt_tokens, len(seq.prompt))
            self._choose([seq], out)
            # The first token goes out now. Left for the next call to carry, it would wait
            # for the decode step to be prepared and launched, or for the whole decode step
            # when the prefill's own step runs one (the LLM example's first token: 8.8 against
            # 5.2 ms in process, 18.4 against 12.3 ms served).
            self._deliver()

    def _expire(self) -> None:
        """Abort the sequences past ``request_timeout_s`` (waiting or running): their slots go back now."""
        limit = time.perf_counter() - self.request_timeout_s
        while self._deadlines and (self._deadlines[0].finish_reason is not None
                                   or self._deadlines[0].arrival <= limit):
            seq = self._deadlines.popleft()  # ended (nothing to do, just forgotten) or expired
            if seq.finish_reason is None:
                self._finish(seq, "abort", error=f"the request timed out: it was not finished "
                                                 f"{self.request_timeout_s:g}s after it arrived (request_timeout_s); "
                                                 f"ask for fewer tokens or retry later", timed_out=True)

    def _steps(self, running: list[Sequence]) -> int:
        """Greedy steps of this decode call: ``decode_steps`` when every running sequence is plain
        greedy, has room for them, and no prompt could be prefilled meanwhile; else 1."""
        steps = self.model.decode_steps
        if steps == 1 or (self.scheduler.free and (self.scheduler.waiting or self._inbox)):
            return 1  # a prompt that could start now would wait for the whole call
        if max(s.position for s in running) + steps > self.model.max_model_len:
            return 1
        if not all(_plain_greedy(s) for s in running):
            return 1  # sampling, penalties and logprobs are applied on the host, token by token
        return steps

    def _choose(self, seqs: list[Sequence], out: StepOutput) -> None:
        """Each sequence's next token: the core's greedy choice, or sampled here from the logits."""
        if all(_plain_greedy(s) for s in seqs):
            for seq, token in zip(seqs, out.greedy):
                self._append(seq, Sampled(token))
            return
        logits = out.logits
        for seq, row in zip(seqs, logits):
            self._append(seq, sample_row(row, seq.params, seq.prompt, seq.output, seq.generator))

    def _append(self, seq: Sequence, sampled: Sampled) -> None:
        now = time.perf_counter()
        seq.output.append(sampled.token)
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.observe(self.metrics.ttft, now - seq.arrival)
        else:
            self.metrics.observe(self.metrics.tpot, now - seq.last_token_at)
        seq.last_token_at = now
        self.metrics.count(self.metrics.generation_tokens)
        reason, stop = self._stop(seq, sampled.token)
        event = TokenEvent(seq.request_id, sampled.token, sampled.logprob, sampled.top, prompt_tokens=len(seq.prompt),
                           completion_tokens=len(seq.output))
        if reason is None:
            self._emit(seq, event)
            return
        self._finish(seq, reason, stop, event)

    def _stop(self, seq: Sequence, token: int) -> tuple[str | None, int | str | None]:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", token
        if seq.text is not None:
            seq.text.add(token)
            if seq.text.stopped is not None:
                return "stop", seq.text.stopped
        if (params.max_tokens is not None and len(seq.output) >= params.max_tokens) \
                or seq.length >= self.model.max_model_len:
            return "length", None
        return None, None

    def _finish(self, seq: Sequence, reason: str, stop: int | str | None = None, event: TokenEvent | None = None,
                error: str | None = None, timed_out: bool = False) -> None:
        self.scheduler.release(seq)
        with self._lock:
            self._by_id.pop(seq.request_id, None)
        seq.finish_reason, seq.stop_reason = reason, stop
        event = event or TokenEvent(seq.request_id, None, prompt_tokens=len(seq.prompt),
                                    completion_tokens=len(seq.output))
        event.finish_reason, event.stop_reason, event.error, event.timed_out = reason, stop, error, timed_out
        if seq.text is not None:
            seq.text.finish()
            event.text = seq.text.text
        self.metrics.count(self.metrics.finished(reason))
        self.metrics.observe(self.metrics.e2e, time.perf_counter() - seq.arrival)
        self._emit(seq, event)

    def _emit(self, seq: Sequence, event: TokenEvent) -> None:
        """Queue ``event`` for the request's sink (see :meth:`_deliver`)."""
        self._pending.append((seq, event))

    def _deliver(self) -> None:
        """Hand every queued event to its request's sink, in order; a sink that fails aborts
        its request, never the engine. The step's metrics are applied first, so a request
        that has its last event is already counted."""
        self.metrics.flush()
        pending, self._pending = self._pending, []
        for seq, event in pending:
            try:
                seq.sink(event)
            except Exception:  # noqa: BLE001 - the sink is the caller's code
                logger.exception("generate request %s: its event sink failed; aborting it", seq.request_id)
                if not event.finished:
                    self.abort(seq.request_id)

    def _gauges(self) -> None:
        self.metrics.set(self.metrics.running, len(self.scheduler.running))
        self.metrics.set(self.metrics.waiting, len(self.scheduler.waiting))
        self.metrics.set(self.metrics.usage, len(self.scheduler.running) / self.scheduler.slots)
