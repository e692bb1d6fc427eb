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

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence as Seq

from ..compile.subgraph import take_meanwhile, while_computing
from ..errors import InvalidInput
from .executor import CoreGroupExecutor, Executor
from .metrics import EngineMetrics
from .model import GenerationModel, StepOutput
from .prefix_cache import PrefixCache
from . import speculative
from .protocol import Admission, Completion, Streams, TokenEvent, check_prompt
from .sampling import SamplingParams, Sampled, generator_for, prompt_logprobs, sample_row
from .scheduler import Scheduler, Sequence, default_budget
from .structured import Grammars
from .text import IncrementalText

__all__ = ["Completion", "Engine", "Streams", "TokenEvent", "check_prompt"]

logger = logging.getLogger("neuron_serve")

DEFAULT_MAX_WAITING = 256


def _plain_greedy(seq: Sequence) -> bool:
    """Whether the core's argmax is the sequence's whole choice (no sampling, penalties, logprobs, bias, ...)."""
    return not seq.params.on_host(len(seq.output))



class Engine(Streams):
    """Continuous batching over ``model``'s KV-cache slots; see the module docstring.

    ``eos_token_ids`` end a sequence (unless its ``ignore_eos``); ``tokenizer`` (a
    transformers tokenizer) is needed only for stop strings. ``max_num_batched_tokens``
    bounds the prompt tokens prefilled per step, ``max_waiting`` the queue. A request
    still waiting or running ``request_timeout_s`` after it was submitted is aborted
    (its last event says ``timed_out``) and its slot is free at the next step.
    """

    def __init__(self, model: GenerationModel | Executor, *, eos_token_ids: Seq[int] = (), tokenizer: Any = None,
                 max_num_batched_tokens: int | None = None, max_waiting: int = DEFAULT_MAX_WAITING,
                 request_timeout_s: float | None = None, name: str = "model", replica: str = "0",
                 device: Any = None, speculative_config: Any = None) -> None:
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise InvalidInput(f"request_timeout_s must be a number of seconds > 0 (or None: no limit); got "
                               f"{request_timeout_s!r}.")
        # A compiled model given as is runs on one core group (``device``; None: the thread's default).
        self.executor = model if isinstance(model, Executor) else CoreGroupExecutor(model, device)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.name = name
        executor = self.executor
        budget = max_num_batched_tokens or default_budget(executor.max_model_len)
        # Decode calls park their free rows in a slot's last decode_steps positions: no cached block reaches them.
        self.prefix = PrefixCache(executor.max_model_len - executor.decode_steps) \
            if executor.prefix_caching else None
        self.scheduler = Scheduler(executor.slots, budget, self.prefix)
        # Speculative decoding (a settings.SpeculativeConfig): its verify models must have been compiled for k.
        self.speculation = speculative_config
        if speculative_config is not None and executor.speculative_tokens != speculative_config.num_speculative_tokens:
            raise InvalidInput(f"speculative_config.num_speculative_tokens is {speculative_config.num_speculative_tokens} "
                               f"but the model's verify calls take {executor.speculative_tokens} proposals; compile "
                               f"it with the same generation.speculative_config.")
        self.request_timeout_s = request_timeout_s
        # Sequences in submission order: with one timeout for all, the first is the first to expire.
        self._deadlines: deque[Sequence] = deque()
        self.metrics = EngineMetrics(name, replica)
        for kind, value in executor.memory().items():
            self.metrics.core_memory[kind].set(value)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.admission = Admission(executor.slots, max_waiting, self._lock)
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._pending: list[tuple[Sequence, TokenEvent]] = []  # events not yet handed to their sinks
        self._structured: Grammars | None = None
        # Ready means ready: the constructor returns once the thread has prepared its cores (the slot move's
        # compile, every bucket's first call), about a second the first request would otherwise wait for.
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    # -- the API ------------------------------------------------------------------------

    def submit(self, prompt: Seq[int], params: SamplingParams, sink: Callable[[TokenEvent], None],
               request_id: str | None = None) -> str:
        """Queue a request; ``sink`` gets its events on the engine's thread. Returns the request id."""
        prompt = self._check_prompt(prompt, params)
        seq = Sequence("", prompt, params, sink, generator=generator_for(params),
                       text=IncrementalText(self.tokenizer, params.stop) if params.stop else None)
        if params.structured is not None:  # compiled here: a constraint the library refuses is the caller's error
            seq.constraint = self._grammars().matcher(params.structured)

        def queue(rid: str) -> None:  # under the lock, once admitted
            seq.request_id = rid
            self._inbox.append(seq)
            self._wake.notify()

        return self.admission.admit(request_id, seq, queue)

    def abort(self, request_id: str) -> None:
        """End a request: it gets a last event with finish_reason "abort"; its slot is free at the next step."""
        with self._lock:
            if request_id in self.admission.open:
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

    def _grammars(self) -> Grammars:
        """Structured outputs' grammars for this engine's tokenizer, made on the first constrained request."""
        if self.tokenizer is None:
            raise InvalidInput("structured outputs need a tokenizer; this engine has none.")
        with self._lock:
            if self._structured is None:
                self._structured = Grammars(self.tokenizer, self.executor.vocab_size, sorted(self.eos_token_ids))
            return self._structured

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    @property
    def model(self) -> GenerationModel:
        """The compiled model the executor calls (its buckets, shapes and cache)."""
        return self.executor.model

    @property
    def max_waiting(self) -> int | None:
        """Requests that may wait for a slot before more are refused."""
        capacity = self.admission.capacity
        return None if capacity is None else capacity - self.admission.slots

    def close(self) -> None:
        """Stop the engine thread; requests still queued or running end with finish_reason "abort"."""
        with self._lock:
            self.admission.closing = True
            self._aborts.update(self.admission.open)
            self._wake.notify()
        self._thread.join(timeout=30)

    # -- checks ---------------------------------------------------------------------------

    def _check_prompt(self, prompt: Seq[int], params: SamplingParams) -> list[int]:
        return check_prompt(prompt, params, vocab_size=self.executor.vocab_size,
                            max_model_len=self.executor.max_model_len, has_tokenizer=self.tokenizer is not None)

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
                take_meanwhile()  # left set when a failed step never launched its call
                self._deliver()
            with self._lock:
                while not self._inbox and not self._aborts and self.scheduler.idle and not self.admission.closing:
                    self._wake.wait()
                if self.admission.closing and self.scheduler.idle and not self._inbox and not self._aborts:
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
            seq = self.admission.open.get(rid)
            if seq is not None:
                self._finish(seq, "abort")
        if self._deadlines:
            self._expire()
        self._prefill()
        for seq, slot in self.scheduler.compaction(self.executor.rows_bucket):
            self.executor.move(seq.slot, slot)
            if self.prefix is not None:
                self.prefix.copy(seq.slot, slot)
            self.scheduler.move(seq, slot)
        running = self.scheduler.decoding()
        proposals = self._propose(running) if running and self.speculation is not None else None
        if proposals is not None and (any(proposals) or self.executor.has_draft):
            # With a draft, every round verifies: the draft fed each sequence's last token, and only a round
            # that takes what the draft fed keeps the draft's cache whole.
            self._speculate(running, proposals)
        elif running:
            steps = self._steps(running)
            started = time.perf_counter()
            out, shape = self.executor.decode([s.output[-1] for s in running], [s.position for s in running],
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
            scored = seq.params.prompt_logprobs is not None
            if seq.copy_from is not None:  # a running sequence's slot holds the prefix: copied, on the core
                self.executor.move(seq.copy_from, seq.slot)
            if scored:  # a prefill that also brings home every prompt position's logits
                out, shape, logits = self.executor.prefill_scored(seq.prompt, seq.slot)
                seq.prompt_logprobs = [None if s is None else (s.logprob, s.top) for s in
                                       prompt_logprobs(seq.prompt, logits, seq.params.prompt_logprobs)]
            elif seq.cached:
                out, shape = self.executor.extend(seq.prompt, seq.slot, seq.cached)
            else:
                out, shape = self.executor.prefill(seq.prompt, seq.slot)
            self.metrics.observe(self.metrics.step(shape), time.perf_counter() - started)
            self.metrics.count(self.metrics.prompt_tokens, len(seq.prompt))
            if self.prefix is not None:
                self.metrics.count(self.metrics.prefix_queries, len(seq.prompt))
                self.metrics.count(self.metrics.prefix_hits, seq.cached)
            if scored and seq.params.max_tokens == 0:  # the prompt's logprobs were all it asked for
                self._finish(seq, "length")
            else:
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

    def _propose(self, running: list[Sequence]) -> list[list[int]]:
        """Each running sequence's proposals this round (none for one that cannot take them, or has no room)."""
        config, limit = self.speculation, self.executor.max_model_len
        k = config.num_speculative_tokens
        drafted = None
        if self.executor.has_draft:
            # The draft runs k + 1 greedy steps for every running sequence (its k proposals, and the last one fed
            # too); with no room for them, one step, which feeds the last token and proposes nothing.
            steps = k + 1 if max(s.position for s in running) + k + 1 <= limit else 1
            drafted = self.executor.draft([s.output[-1] for s in running], [s.position for s in running],
                                          [s.slot for s in running], steps)
            k = min(k, steps - 1)
        proposals = []
        for i, seq in enumerate(running):
            room = min(k, limit - 1 - seq.position)
            if seq.params.max_tokens is not None:  # a round adds up to one more than it proposes
                room = min(room, seq.params.max_tokens - len(seq.output) - 1)
            if room <= 0 or not speculative.speculable(seq.params, len(seq.output)):
                proposals.append([])
            elif drafted is not None:
                proposals.append(list(drafted[i][:room]))
            else:
                proposals.append(speculative.ngram_proposals(seq.prompt + seq.output, room, config.prompt_lookup_min,
                                                             config.prompt_lookup_max))
        return proposals

    def _speculate(self, running: list[Sequence], proposals: list[list[int]]) -> None:
        """One verify call for every running sequence: its last token and proposals; each takes what it accepts."""
        started = time.perf_counter()
        out, shape = self.executor.verify([[s.output[-1], *p] for s, p in zip(running, proposals)],
                                          [s.position for s in running], [s.slot for s in running])
        self.metrics.observe(self.metrics.step(shape), time.perf_counter() - started)
        greedy = out.greedy
        host = [i for i, s in enumerate(running) if not _plain_greedy(s)]
        logits = out.logits if host else None
        for i, (seq, proposed) in enumerate(zip(running, proposals)):
            if not proposed:  # one token, from the first position, as a decode step gives it
                if logits is None or _plain_greedy(seq):
                    self._append(seq, Sampled(int(greedy[i][0])))
                else:
                    self._choose_from(seq, logits[i][0])
                continue
            if seq.params.greedy:
                taken = speculative.accept_greedy(proposed, greedy[i])
            else:
                taken = speculative.accept_sampled(proposed, logits[i], seq.params, seq.generator)
            self.metrics.speculated(proposed, taken)
            for token in taken:
                self._append(seq, Sampled(token))
                if seq.finish_reason is not None:
                    break

    def _choose_from(self, seq: Sequence, row) -> None:
        """One sequence's next token from its logits on the host (sampling, penalties, logprobs, a grammar)."""
        sampled = sample_row(row, seq.params, seq.prompt, seq.output, seq.generator, self.eos_token_ids,
                             seq.constraint)
        if seq.constraint is not None and not seq.constraint.accept(sampled.token):
            self._finish(seq, "error", error=f"token {sampled.token} left the structured output's grammar")
            return
        self._append(seq, sampled)

    def _steps(self, running: list[Sequence]) -> int:
        """Greedy steps of this decode call: ``decode_steps`` when every running sequence is plain
        greedy, has room for them, and no prompt could be prefilled meanwhile; else 1."""
        steps = self.executor.decode_steps
        if steps == 1 or (self.scheduler.free and (self.scheduler.waiting or self._inbox)):
            return 1  # a prompt that could start now would wait for the whole call
        if max(s.position for s in running) + steps > self.executor.max_model_len:
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
        for seq, row in zip(seqs, out.logits):
            self._choose_from(seq, row)

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
        if seq.prompt_logprobs is not None:  # on the first event only
            event.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        if reason is None:
            self._emit(seq, event)
            return
        self._finish(seq, reason, stop, event)

    def _stop(self, seq: Sequence, token: int) -> tuple[str | None, int | str | None]:
        params = seq.params
        if token in params.stop_token_ids or (seq.constraint is not None and seq.constraint.done):
            return "stop", token
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", token
        if seq.text is not None:
            seq.text.add(token)
            if seq.text.stopped is not None:
                return "stop", seq.text.stopped
        if (params.max_tokens is not None and len(seq.output) >= params.max_tokens) \
                or seq.length >= self.executor.max_model_len:
            return "length", None
        return None, None

    def _finish(self, seq: Sequence, reason: str, stop: int | str | None = None, event: TokenEvent | None = None,
                error: str | None = None, timed_out: bool = False) -> None:
        if self.prefix is not None and seq.slot is not None and self.scheduler.running.get(seq.slot) is seq:
            if error is None or timed_out:  # its slot keeps what was written: every token but the last
                self.prefix.hold(seq.slot, seq.prompt + seq.output[:-1])
            else:  # a failed call may have left the slot half written
                self.prefix.forget(seq.slot)
        self.scheduler.release(seq)
        self.admission.pop(seq.request_id)
        seq.finish_reason, seq.stop_reason = reason, stop
        event = event or TokenEvent(seq.request_id, None, prompt_tokens=len(seq.prompt),
                                    completion_tokens=len(seq.output), prompt_logprobs=seq.prompt_logprobs)
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
