"""The generation engine: a thread that steps the scheduler over one core group's executor.

The engine speaks tokens, and takes requests as the front end (``frontend/processor.py``) admitted
them: :meth:`Engine.submit` queues an :class:`~.protocol.EngineRequest` with a sink for its
:class:`~.protocol.TokenEvent` (one per new token; the last says why the sequence ended),
:meth:`Engine.abort` ends one by id (its slot is free at the next step).

One thread drives the core (torch-xla replays an executable on the calling thread's
device). Each step (:meth:`Engine.step`, vLLM v1's ``EngineCore.step``) has three parts:
the scheduler's plan (``scheduler.py``; the plan is data, ``plan.py``), each of its calls
made by the runner (``runner/calls.py``: the prompts it prefills whole, then one call for every
running row: a decode, a verify round of speculative decoding, or a mixed call that also
writes a prompt's chunk), and after each call the request states updated from its output
(``states.py``: tokens, stops, ends, events). A step's events reach their requests while the
next step's first call computes (a call returns once the core has it; reading its tokens
waits): the event loop that streams them then holds the GIL while the core works, not while
the engine prepares the call. A prompt's first token goes out right after its prefill.
With async scheduling (vLLM's), a step whose only work is the running rows' decode launches
the next decode from the last one's tokens on the core before reading them (:class:`Ahead`),
so reading, stops and events run beside the core's next call; a row ends one call late.
Between steps the engine sleeps while nothing is waiting or running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ...buckets import usage as bucket_usage
from ...errors import AdapterNotLoaded, InvalidInput
from ...targets.pjrt import emulated
from ..runner.executor import CoreGroupExecutor, Executor
from .metrics import EngineMetrics
from ..runner.model import GenerationModel
from ..runner.weights import swap_weights
from .plan import Admit, Decode, Mixed, Move, Prefill, PrefillBatch
from .prefix_cache import PrefixCache
from ..frontend.protocol import EngineRequest, Engines, TokenEvent
from .request import Sequence
from ..runner.calls import CallOutput, Launched, Runner
from ..runner.output import waited as output_wait
from .scheduler import Scheduler, default_budget
from ..sample import choice
from ..spec_decode.proposer import Proposer
from .states import RequestStates

if TYPE_CHECKING:
    import torch

    from ..lora.adapters import AdapterPolicy

logger = logging.getLogger("neuron_serve")

WAITING_POLL_S = 0.05  # how often requests that wait for a model still compiling look again
STEP_LOG = 4096  # steps whose tokens Engine.step_log keeps


@dataclass
class StepStats:
    """What one step did, recorded once (as vLLM's SchedulerStats): its prompt tokens, decode rows and chunk."""

    prompt_tokens: int = 0
    decode_rows: int = 0
    chunk_tokens: int = 0
    calls: list[tuple[str, float]] = field(default_factory=list)  # (bucket label, seconds) of each call
    seconds: float = 0.0  # the whole step
    core_wait: float = 0.0  # of which the engine thread waited for the calls' outputs


class Overlap:
    """The step before's events, delivered once, while this step's first call computes (or at its end)."""

    def __init__(self, deliver: Callable[[], None]) -> None:
        self._deliver = deliver
        self._done = False

    def __call__(self) -> None:
        if not self._done:
            self._done = True
            self._deliver()


@dataclass
class Ahead:
    """A one-step decode launched and not read: the next step launches the decode after it from its tokens on the
    core (when nothing else is to be done), then reads it."""

    call: Decode
    launched: Launched
    started: float
    stale: frozenset[str] = frozenset()  # rows fed a token the host then replaced: what they got here is not theirs


class Engine(Engines):
    """Continuous batching over an executor's KV-cache slots; see the module docstring.

    ``eos_token_ids`` end a sequence (unless its ``ignore_eos``); ``tokenizer`` (a
    transformers tokenizer) is needed only for structured outputs' matchers.
    ``max_num_batched_tokens`` bounds the tokens of a step (decode rows, then prompt tokens); with a model compiled
    for chunked prefill (mixed models), ``long_prefill_token_threshold`` and ``max_num_partial_prefills`` shape
    its chunks (scheduler.py). With ``async_scheduling`` (vLLM's; None: on a Neuron device where it applies, off on
    emulated cores, where the host's work and the calls share the CPUs), while nothing but the
    running rows' decode is to be done, each step launches the next decode from the last one's tokens on the core
    before it reads them, so the host's part of a step runs while the core computes; a row ends one call late (that
    call's token for it is dropped, never sent). Speculative decoding and multi-step decodes do not feed one call's
    tokens to the next: with them it is off. ``step_log`` keeps the last steps' (prompt tokens, decode rows, chunk
    tokens). A request
    still waiting or running ``request_timeout_s`` after it was submitted is aborted (its
    last event says ``timed_out``) and its slot is free at the next step.
    """

    def __init__(self, model: GenerationModel | Executor, *, eos_token_ids: Any = (), tokenizer: Any = None,
                 max_num_batched_tokens: int | None = None, request_timeout_s: float | None = None,
                 name: str = "model", replica: str = "0", device: Any = None,
                 speculative_config: Any = None, adapters: AdapterPolicy | None = None,
                 long_prefill_token_threshold: int = 0, max_num_partial_prefills: int = 1,
                 async_scheduling: bool | None = None) -> None:
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise InvalidInput(f"request_timeout_s must be a number of seconds > 0 (or None: no limit); got "
                               f"{request_timeout_s!r}.")
        # A compiled model given as is runs on one core group (``device``; None: the thread's default).
        self.executor = model if isinstance(model, Executor) else CoreGroupExecutor(model, device)
        executor = self.executor
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.name = name
        chunked = bool(executor.chunks)
        budget = max_num_batched_tokens or default_budget(executor.max_model_len, chunked, executor.slots)
        # Decode calls park their free rows in a slot's last decode_steps positions: no cached block reaches them.
        prefix = PrefixCache(executor.max_model_len - executor.decode_steps) if executor.prefix_caching else None
        # LoRA: the adapters this engine's buffers hold (lora/adapters.py); None serves the base model only.
        self.adapters = None
        if adapters is not None:
            from ..lora.adapters import Adapters  # noqa: PLC0415 - safetensors and the adapter reader, with LoRA only

            self.adapters = Adapters(executor, adapters)
        self.scheduler = Scheduler(executor.slots, budget, prefix, models=executor, adapters=self.adapters,
                                   chunked=chunked, long_prefill_token_threshold=long_prefill_token_threshold,
                                   max_num_partial_prefills=max_num_partial_prefills)
        self.step_log: deque[tuple[int, int, int]] = deque(maxlen=STEP_LOG)
        self.metrics = EngineMetrics(name, replica)
        # The sizes asked for and the padding their buckets cost (buckets/usage.py), shared by the replica's engines.
        self.usage = bucket_usage.for_model(name, replica)
        # With auto buckets, what looks at those sizes and switches the buckets while serving (compiling/rebucket.py).
        self.rebucketings: list = []
        proposer = Proposer(speculative_config, executor) if speculative_config is not None else None
        self.runner = Runner(executor, self.eos_token_ids, self.adapters is not None, proposer)
        feeds = proposer is None and executor.decode_steps == 1
        if async_scheduling and not feeds:
            raise InvalidInput("async_scheduling feeds each one-step decode's tokens to the next on the core; "
                               "speculative decoding and decode_steps > 1 do not decode that way: turn it off (or "
                               "leave it unset).")
        # Unset: on a Neuron device, whose calls run apart from the host; not on emulated cores, whose calls compute
        # on the CPUs the host's work needs (served, one stream: 46.3 ms a token with it, 39.9 without).
        self.async_scheduling = (feeds and not emulated()) if async_scheduling is None else async_scheduling
        self._ahead: Ahead | None = None
        for kind, value in executor.memory().items():
            self.metrics.held(kind, value)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.states = RequestStates(self.scheduler, self.metrics, self.eos_token_ids, executor.max_model_len,
                                    self._lock, self.abort, self.adapters, request_timeout_s)
        self._inbox: list[Sequence] = []
        self._aborts: dict[str, str] = {}  # request id -> the finish reason its abort gives
        self._closing = False
        self._matchers: Any = None
        # Ready means ready: the constructor returns once the thread has prepared its cores (the slot move's
        # compile, every bucket's first call), about a second the first request would otherwise wait for.
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error
        build = getattr(getattr(self.executor, "model", None), "build", None)
        if build is not None:  # its start-up calls are done: the background compiles may run beside the steps
            build.resume()

    # -- the API ------------------------------------------------------------------------

    def submit(self, request: EngineRequest, sink: Callable[[TokenEvent], None]) -> None:
        seq = Sequence(request.request_id, request.prompt, request.params, sink)
        if request.grammar is not None:
            seq.constraint = self._matcher(request.grammar)
        if request.adapter is not None:  # counted from now, so an unload lets it finish on its adapter
            if self.adapters is None:
                raise AdapterNotLoaded(f"adapter {request.adapter!r} is not loaded.")
            seq.adapter, seq.adapter_key = request.adapter, self.adapters.take(request.adapter)
        with self._lock:
            self.states.open[seq.request_id] = seq
            self._inbox.append(seq)
            self._wake.notify()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        with self._lock:
            if request_id in self.states.open:
                self._aborts[request_id] = reason
                self._wake.notify()

    def replace_weights(self, lm: torch.nn.Module) -> int:
        """Serve the weights of ``lm`` (a fine-tune: the same architecture, dtype and quantization) from the next
        call on, without compiling (model.swap_weights). Returns how many weights were replaced."""
        return swap_weights([self.model], lm, self.model.build)

    def load_adapter(self, name: str, path: str) -> None:
        """Serve LoRA adapter ``name`` from PEFT directory ``path`` (read and checked now: AdapterError names the
        file and the reason); it reaches the core when a request first asks for it, without a compile."""
        if self.adapters is None:
            raise InvalidInput("this engine serves no LoRA adapters (generation.lora is not set)")
        self.adapters.add(name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` to new requests; the ones already taken (running, or waiting for a slot)
        finish on it, and it is forgotten when the last ends. KeyError if it is not loaded."""
        if self.adapters is None:
            raise KeyError(name)
        self.adapters.unload(name)

    @property
    def request_timeout_s(self) -> float | None:
        """Seconds after its submission a request still waiting or running is aborted (None: no limit); a change
        applies to the requests submitted after it."""
        return self.states.request_timeout_s

    @request_timeout_s.setter
    def request_timeout_s(self, seconds: float | None) -> None:
        self.states.request_timeout_s = seconds

    @property
    def running(self) -> int:
        """Sequences holding a slot."""
        return len(self.scheduler.running)

    @property
    def free_slots(self) -> int:
        """Slots not held nor promised to a waiting request (negative when requests wait)."""
        with self._lock:
            return len(self.scheduler.free) - len(self.scheduler.waiting) - len(self._inbox)

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    @property
    def model(self) -> GenerationModel:
        """The compiled model the executor calls (its buckets, shapes and cache)."""
        return self.executor.model

    def close(self) -> None:
        """Stop the engine thread; requests still queued or running end with finish_reason "abort"."""
        with self._lock:
            self._closing = True
            self._aborts.update({rid: "abort" for rid in self.states.open})
            self._wake.notify()
        self._thread.join(timeout=30)
        self.usage.save()

    def _matcher(self, grammar: str) -> Any:
        """A matcher over a grammar the front end compiled."""
        with self._lock:
            if self._matchers is None:
                from ..frontend.structured import Matchers  # noqa: PLC0415 - only structured requests need xgrammar

                self._matchers = Matchers(self.tokenizer, self.executor.vocab_size, sorted(self.eos_token_ids))
        return self._matchers.matcher(grammar)

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self.executor.start()
        except BaseException as exc:  # noqa: BLE001 - raised again by the constructor, on its thread
            self._start_error = exc
            return
        finally:
            self._started.set()
        while True:
            if self.scheduler.idle:  # no model call is coming to carry them
                self.states.deliver()
            with self._lock:
                while not self._inbox and not self._aborts and self.scheduler.idle and not self._closing:
                    self._wake.wait()
                if self._closing and self.scheduler.idle and not self._inbox and not self._aborts:
                    return
                arrived, self._inbox = self._inbox, []
                aborted, self._aborts = self._aborts, {}
            self.states.opened(arrived)
            try:
                self.step(aborted)
            except Exception as exc:  # a failed call fails its sequences, never the engine
                logger.exception("generation step failed")
                self.states.fail_running(exc)
            if not self.scheduler.running and self.scheduler.waiting:  # each waits for a model still compiling
                with self._lock:
                    if not self._inbox and not self._aborts and not self._closing:
                        self._wake.wait(WAITING_POLL_S)

    def step(self, aborted: dict[str, str] | None = None) -> StepStats:
        """One iteration, vLLM v1's ``EngineCore.step``: the ends asked for, the scheduler's plan, each call made
        and the request states updated from its output. The events of the step before are delivered while this
        step's first call computes (or at its end if it makes none); a prompt's first token right after it."""
        started, waited_before = time.perf_counter(), output_wait()
        overlap = Overlap(self.states.deliver)
        self.states.abort(aborted or {})
        self.states.expire()
        stats = StepStats()
        if self._ahead is None or not self._take_ahead(overlap, stats):
            plan = self.scheduler.schedule()
            self.states.fail(plan.failed)
            stats.prompt_tokens = plan.prompt_tokens
            for call in plan.calls:
                if isinstance(call, Admit):
                    self.runner.admit(call)
                elif isinstance(call, Move):
                    self.runner.move(call)
                else:
                    self._call(call, overlap, stats)
        stats.seconds, stats.core_wait = time.perf_counter() - started, output_wait() - waited_before
        self._record(stats)
        overlap()  # no model call this step carried them
        return stats

    def _take_ahead(self, overlap: Overlap, stats: StepStats) -> bool:
        """Read the decode the last step launched and apply it; first, when there is nothing to plan (no prompt
        that may start, no rows to move into a smaller bucket) and none of its rows ended or fell behind, launch the
        next decode of its rows from its tokens on the core (a row sure to end with the token read now is left
        out). True when it launched one: the step is done."""
        pending, self._ahead = self._ahead, None
        rows = self.states.rows(pending.call.rows)
        follow = None
        # A prompt that may start now, or rows to move into a smaller decode bucket: read first, then plan.
        planned = (self.scheduler.waiting and self.scheduler.free) or self.scheduler.would_compact()
        if not pending.stale and len(rows) == len(pending.launched.rows) and not planned:
            going = [s for s in rows if not self._ends_with_next(s)]
            if going and not any(choice.on_host(s, ahead=1) for s in going):
                follow = Ahead(Decode(tuple(s.request_id for s in going)),
                               self.runner.launch(going, 1, overlap, after=pending.launched), time.perf_counter())
                self.metrics.count(self.metrics.decodes_ahead)
        live = [s for s in rows if s.request_id not in pending.stale]
        if len(live) < len(pending.launched.rows):  # ended with the token before, or fed one the host replaced
            self.metrics.count(self.metrics.ahead_dropped, len(pending.launched.rows) - len(live))
        if live:
            output = self.runner.take(pending.launched, live)
            self.states.update_from_output(pending.call, live, output)
            self._record_call(output, time.perf_counter() - pending.started, stats)
            stats.decode_rows = len(live)
            if follow is not None:  # a row whose token the host chose otherwise was fed the core's
                follow.stale = frozenset(s.request_id for s, core in zip(live, output.core)
                                         if not s.finished and s.output[-1] != core)
        if follow is None:
            return False
        self._ahead = follow
        self.states.deliver()  # while the core computes the next call
        return True

    def _ends_with_next(self, seq: Sequence) -> bool:
        """Whether ``seq`` ends by length with the token read next (its output one longer)."""
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and len(seq.output) + 1 >= max_tokens) or \
            seq.length + 1 >= self.executor.max_model_len

    def _call(self, call: Prefill | PrefillBatch | Decode | Mixed, overlap: Overlap, stats: StepStats) -> None:
        """One model call of the plan: made, its output applied, its time and padding recorded."""
        started = time.perf_counter()
        if isinstance(call, PrefillBatch):
            rows = self.states.rows(tuple(p.request_id for p in call.prompts))
            self._queued(rows, started)
            output = self.runner.prefill_batch(rows, overlap)
        elif isinstance(call, Prefill):
            rows = self.states.rows((call.request_id,))
            self._queued(rows, started)
            output = self.runner.prefill(rows[0], call.scored, call.cached, overlap)
        elif isinstance(call, Mixed):
            rows = [*self.states.rows(call.rows), self.states.open[call.chunk.request_id]]
            if call.chunk.start == rows[-1].cached:  # its first chunk
                self._queued(rows[-1:], started)
            output = self.runner.mixed(rows[:-1], rows[-1], call.chunk, overlap)
            stats.decode_rows, stats.chunk_tokens = len(rows) - 1, call.chunk.length
        else:
            rows = self.states.rows(call.rows)
            if not rows:  # each ended with its first token
                return
            steps = self.scheduler.decode_steps(rows, self.executor.decode_steps, self.executor.max_model_len,
                                                arriving=bool(self._inbox))
            stats.decode_rows = len(rows)
            if self.async_scheduling:  # read by the next step, once it has launched the decode after it
                self._ahead = Ahead(call, self.runner.launch(rows, steps, overlap), started)
                return
            output = self.runner.decode(rows, steps, overlap)
        first_token = self.states.update_from_output(call, rows, output)
        self._record_call(output, time.perf_counter() - started, stats)
        if first_token:
            self.states.deliver()

    # -- what was done, recorded ------------------------------------------------------------

    def _record_call(self, output: CallOutput, seconds: float, stats: StepStats) -> None:
        """A call's time, and its real and padded sizes: recorded, counted with the metrics, looked at by the
        re-bucketing of their family."""
        self.metrics.observe(self.metrics.step(output.shape), seconds)
        stats.calls.append((output.shape.label, seconds))
        for family, size, bucket in output.used:
            real, padded = self.usage.record(family, size, bucket)
            self.metrics.count(real, size)
            self.metrics.count(padded, max(bucket - size, 0))
            for rebucketing in self.rebucketings:
                if rebucketing.family == family:
                    rebucketing.observe()

    def _queued(self, seqs: list[Sequence], now: float) -> None:
        """The time each of ``seqs`` waited for its prompt's prefill, which starts ``now``."""
        for seq in seqs:
            self.metrics.observe(self.metrics.queue, now - seq.arrival)

    def _record(self, stats: StepStats) -> None:
        """A step's tokens, its time (host and waiting for the core) and the gauges of the requests it leaves."""
        self.metrics.step_tokens(stats.prompt_tokens, stats.decode_rows, stats.chunk_tokens > 0)
        if stats.calls:
            self.metrics.observe(self.metrics.step_core_wait, stats.core_wait)
            self.metrics.observe(self.metrics.step_host, stats.seconds - stats.core_wait)
        self.step_log.append((stats.prompt_tokens, stats.decode_rows, stats.chunk_tokens))
        scheduler = self.scheduler
        self.metrics.set(self.metrics.running, len(scheduler.running))
        self.metrics.set(self.metrics.waiting, len(scheduler.waiting))
        self.metrics.set(self.metrics.usage, len(scheduler.running) / scheduler.slots)
        if self.adapters is not None:
            self.metrics.lora_requests(
                self.adapters.max_loras,
                ",".join(sorted({s.adapter for s in scheduler.running.values() if s.adapter is not None})),
                ",".join(sorted({s.adapter for s in scheduler.waiting if s.adapter is not None})))
