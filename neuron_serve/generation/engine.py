"""The generation engine: a thread that steps the scheduler over one core group's executor.

The engine speaks tokens, and takes requests as the front end (``frontend.py``) admitted
them: :meth:`Engine.submit` queues an :class:`~.protocol.EngineRequest` with a sink for its
:class:`~.protocol.TokenEvent` (one per new token; the last says why the sequence ended),
:meth:`Engine.abort` ends one by id (its slot is free at the next step).

One thread drives the core (torch-xla replays an executable on the calling thread's
device). Each step (:meth:`Engine.step`, vLLM v1's ``EngineCore.step``) applies aborts and
timeouts, takes the scheduler's plan (``scheduler.py``: everything the step holds) and
executes it: the prompts it prefills whole, one call each, then one call for every running
sequence: a decode (``decode_steps`` tokens a row when every row can take them), a verify of
speculative proposals (``speculation.py``), or, with chunked prefill, a mixed call that also
writes a prompt's chunk (``mixed.py``). The core chooses each token (``choice.py``);
the stop rules (``stopping.py``) end sequences as their tokens arrive. A step's events
reach their requests while the next step's model call computes (a call returns once the
core has it; reading its tokens waits): the event loop that streams them then holds the
GIL while the core works, not while the engine prepares the call. Between steps it
sleeps while nothing is waiting or running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from ..errors import AdapterNotLoaded, InvalidInput
from . import choice
from ..buckets import usage as bucket_usage
from .executor import CoreGroupExecutor, Executor
from .metrics import EngineMetrics
from .model import GenerationModel, swap_weights
from .prefix_cache import PrefixCache
from .protocol import EngineRequest, Engines, TokenEvent
from .sampler import GREEDY
from .sampling import Sampled, prompt_logprobs
from .scheduler import Chunk, Scheduler, Sequence, default_budget
from .speculation import Speculation
from .stopping import stop_reason

if TYPE_CHECKING:
    import torch

    from .adapters import AdapterPolicy

logger = logging.getLogger("neuron_serve")

WAITING_POLL_S = 0.05  # how often requests that wait for a model still compiling look again
STEP_LOG = 4096  # steps whose tokens Engine.step_log keeps


class Engine(Engines):
    """Continuous batching over an executor's KV-cache slots; see the module docstring.

    ``eos_token_ids`` end a sequence (unless its ``ignore_eos``); ``tokenizer`` (a
    transformers tokenizer) is needed only for structured outputs' matchers.
    ``max_num_batched_tokens`` bounds the tokens of a step (decode rows, then prompt tokens); with a model compiled
    for chunked prefill (mixed models), ``long_prefill_token_threshold`` and ``max_num_partial_prefills`` shape
    its chunks (scheduler.py). ``step_log`` keeps the last steps' (prompt tokens, decode rows, chunk tokens). A request
    still waiting or running ``request_timeout_s`` after it was submitted is aborted (its
    last event says ``timed_out``) and its slot is free at the next step.
    """

    def __init__(self, model: GenerationModel | Executor, *, eos_token_ids: Any = (), tokenizer: Any = None,
                 max_num_batched_tokens: int | None = None, request_timeout_s: float | None = None,
                 name: str = "model", replica: str = "0", device: Any = None,
                 speculative_config: Any = None, adapters: AdapterPolicy | None = None,
                 long_prefill_token_threshold: int = 0, max_num_partial_prefills: int = 1) -> None:
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
        # With chunked prefill the default budget holds a whole chunk and a decode row for every slot.
        budget = max_num_batched_tokens or default_budget(executor.max_model_len) + (executor.slots if chunked else 0)
        # Decode calls park their free rows in a slot's last decode_steps positions: no cached block reaches them.
        self.prefix = PrefixCache(executor.max_model_len - executor.decode_steps) \
            if executor.prefix_caching else None
        # LoRA: the adapters this engine's buffers hold (adapters.py); None serves the base model only.
        self.adapters = None
        if adapters is not None:
            from .adapters import Adapters  # noqa: PLC0415 - safetensors and the adapter reader, with LoRA only

            self.adapters = Adapters(executor, adapters)
        self.scheduler = Scheduler(executor.slots, budget, self.prefix, models=executor, adapters=self.adapters,
                                   chunked=chunked, long_prefill_token_threshold=long_prefill_token_threshold,
                                   max_num_partial_prefills=max_num_partial_prefills)
        self.step_log: deque[tuple[int, int, int]] = deque(maxlen=STEP_LOG)
        self.request_timeout_s = request_timeout_s
        # Sequences in submission order: with one timeout for all, the first is the first to expire.
        self._deadlines: deque[Sequence] = deque()
        self.metrics = EngineMetrics(name, replica)
        # The sizes asked for and the padding their buckets cost (bucket_usage.py), shared by the replica's engines.
        self.usage = bucket_usage.for_model(name, replica)
        # With auto buckets, what looks at those sizes and switches the buckets while serving (rebucket.py).
        self.rebucketings: list = []
        self.speculation = Speculation(speculative_config, executor, self.metrics, self.eos_token_ids) \
            if speculative_config is not None else None
        for kind, value in executor.memory().items():
            self.metrics.held(kind, value)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._open: dict[str, Sequence] = {}  # every request submitted and not ended, by id
        self._inbox: list[Sequence] = []
        self._aborts: dict[str, str] = {}  # request id -> the finish reason its abort gives
        self._closing = False
        self._pending: list[tuple[Sequence, TokenEvent]] = []  # events not yet handed to their sinks
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
        with self._lock:  # an unload sees this request, or this request sees the unload
            if request.adapter is not None:
                if self.adapters is None or request.adapter not in self.adapters:
                    raise AdapterNotLoaded(f"adapter {request.adapter!r} is not loaded.")
                seq.adapter, seq.adapter_key = request.adapter, self.adapters.key(request.adapter)
            self._open[seq.request_id] = seq
            self._inbox.append(seq)
            self._wake.notify()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        with self._lock:
            if request_id in self._open:
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
        if self.adapters is None or name not in self.adapters:
            raise KeyError(name)
        with self._lock:
            if any(seq.adapter == name for seq in self._open.values()):
                self.adapters.retire(name)
            else:
                self.adapters.remove(name)

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
            self._aborts.update({rid: "abort" for rid in self._open})
            self._wake.notify()
        self._thread.join(timeout=30)
        self.usage.save()

    def _matcher(self, grammar: str) -> Any:
        """A matcher over a grammar the front end compiled."""
        with self._lock:
            if self._matchers is None:
                from .structured import Matchers  # noqa: PLC0415 - only structured requests need xgrammar

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
                self._deliver()
            with self._lock:
                while not self._inbox and not self._aborts and self.scheduler.idle and not self._closing:
                    self._wake.wait()
                if self._closing and self.scheduler.idle and not self._inbox and not self._aborts:
                    return
                arrived, self._inbox = self._inbox, []
                aborted, self._aborts = self._aborts, {}
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
            if not self.scheduler.running and self.scheduler.waiting:  # each waits for a model still compiling
                with self._lock:
                    if not self._inbox and not self._aborts and not self._closing:
                        self._wake.wait(WAITING_POLL_S)

    def step(self, aborted: dict[str, str] | None = None) -> None:
        """One iteration, vLLM v1's ``EngineCore.step``: the scheduler's plan (scheduler.py), then its calls, then
        the sequences updated from their tokens.

        The events of the step before are delivered while this step's first model call
        computes, or at its end if it makes none; a prefill's first token right after it."""
        carried = [False]

        def meanwhile() -> None:  # once, after the first call of this step is launched
            if not carried[0]:
                carried[0] = True
                self._deliver()

        for rid, reason in (aborted or {}).items():
            seq = self._open.get(rid)
            if seq is not None:
                self._finish(seq, reason)
        if self._deadlines:
            self._expire()
        plan = self.scheduler.schedule()
        for seq, error in plan.failed:
            self._finish(seq, "error", error=error)
        # Each admitted prompt is placed after the prompts admitted before it are prefilled: its cached prefix may
        # be one of theirs, copied from their slot once written.
        whole, admitted = {id(seq) for seq in plan.prefills}, {id(seq) for seq in plan.admitted}
        for seq in plan.prefills:
            if id(seq) not in admitted:  # admitted in an earlier step, placed then
                self._prefill(seq, meanwhile)
        for seq in plan.admitted:
            self._place(seq)
            if id(seq) in whole:
                self._prefill(seq, meanwhile)
        for seq, slot in plan.moves:
            self.executor.move(seq.slot, slot)
            if self.prefix is not None:
                self.prefix.copy(seq.slot, slot)
            self.scheduler.move(seq, slot)
        rows = [seq for seq in plan.decode if seq.finish_reason is None]
        if plan.chunk is not None:
            self._mixed(rows, plan.chunk, meanwhile)
        elif rows:
            self._decode(rows, meanwhile)
        self.metrics.step_tokens(plan.prompt_tokens, len(rows), plan.chunk is not None)
        self.step_log.append((plan.prompt_tokens, len(rows), plan.chunk.length if plan.chunk is not None else 0))
        self._gauges()
        meanwhile()  # no model call this step carried them

    def _place(self, seq: Sequence) -> None:
        """A sequence admitted this step: a running one's cached prefix copied into its slot, its adapter set."""
        if seq.copy_from is not None:  # a running sequence's slot holds the prefix: copied, on the core
            self.executor.move(seq.copy_from, seq.slot)
        if self.adapters is not None:
            self.executor.assign(seq.slot, seq.adapter_slot or 0)

    def _decode(self, running: list[Sequence], meanwhile: Callable[[], None]) -> None:
        """One call for every running sequence: a verify round, or a decode of one or ``decode_steps`` tokens."""
        started = time.perf_counter()
        proposals = self.speculation.propose(running) if self.speculation is not None else None
        verified = self.speculation.verify(running, proposals, meanwhile) \
            if proposals is not None and self.speculation.wanted(proposals) else None
        if verified is not None:
            taken, shape = verified
        else:  # no round this step (or its verify model still compiles): one decode
            steps = self._steps(running)
            out, shape = self.executor.decode([s.output[-1] for s in running], [s.position for s in running],
                                              [s.slot for s in running], steps, choice.for_call(running))
            meanwhile()
            tokens = choice.Taken(running, out, self.eos_token_ids)
            taken = [tokens.steps(i) if shape.steps > 1 else [tokens.at(i)] for i in range(len(running))]
        self.metrics.observe(self.metrics.step(shape), time.perf_counter() - started)
        self._used("decode_rows", len(running), shape.rows)
        for seq, row in zip(running, taken):
            for sampled in row:  # the tokens after its end were computed for nothing
                self._append(seq, sampled)
                if seq.finish_reason is not None:
                    break

    def _mixed(self, running: list[Sequence], chunk: Chunk, meanwhile: Callable[[], None]) -> None:
        """One mixed call: every running sequence's next token and ``chunk`` written into its slot; a chunk that
        ends its prompt gives the prompt's first token."""
        started = time.perf_counter()
        seq = chunk.seq
        rows = [*running, seq]
        out, shape = self.executor.mixed([s.output[-1] for s in running], [s.position for s in running],
                                         [s.slot for s in running], chunk.tokens, chunk.start, seq.slot,
                                         choice.for_call(rows))
        meanwhile()
        self._used("decode_rows", len(running), shape.rows)
        self._used("chunk", chunk.length, shape.tokens)
        self.scheduler.wrote(seq, chunk.start + chunk.length)
        tokens = choice.Taken(rows, out, self.eos_token_ids)
        self.metrics.observe(self.metrics.step(shape), time.perf_counter() - started)
        for i, row in enumerate(running):
            self._append(row, tokens.at(i))
        if chunk.last:
            self._append(seq, tokens.at(len(running)))
            self._prefilled(seq)

    def _prefill(self, seq: Sequence, meanwhile: Callable[[], None]) -> None:
        """Prefill ``seq``'s prompt whole into its slot (after what its slot holds); its first token goes out at
        once."""
        started = time.perf_counter()
        scored = seq.params.prompt_logprobs is not None
        core_choice = choice.for_call([seq])
        row = core_choice[0] if core_choice is not None else GREEDY
        if scored:  # a prefill that also brings home every prompt position's logits
            out, shape, logits = self.executor.prefill_scored(seq.prompt, seq.slot, row)
            seq.prompt_logprobs = [None if s is None else (s.logprob, s.top) for s in
                                   prompt_logprobs(seq.prompt, logits, seq.params.prompt_logprobs)]
        else:
            # A prompt whose prefix the slot holds computes only the rest, once its extend model is compiled.
            extended = self.executor.extend(seq.prompt, seq.slot, seq.cached, row) if seq.cached else None
            out, shape = extended or self.executor.prefill(seq.prompt, seq.slot, row)
        meanwhile()
        self._used("prefill", len(seq.prompt) - (seq.cached if shape.kind == "extend" else 0), shape.tokens)
        self.scheduler.wrote(seq, len(seq.prompt))
        if scored and seq.params.max_tokens == 0:  # the prompt's logprobs were all it asked for
            self._finish(seq, "length")
        else:
            self._append(seq, choice.Taken([seq], out, self.eos_token_ids).at(0))
        self.metrics.observe(self.metrics.step(shape), time.perf_counter() - started)
        self._prefilled(seq)

    def _used(self, family: str, size: int, bucket: int) -> None:
        """A call ran ``size`` real units of ``family`` on ``bucket``: recorded, and counted with the metrics."""
        real, padded = self.usage.record(family, size, bucket)
        self.metrics.count(real, size)
        self.metrics.count(padded, max(bucket - size, 0))
        for rebucketing in self.rebucketings:
            if rebucketing.family == family:
                rebucketing.observe()

    def _prefilled(self, seq: Sequence) -> None:
        """``seq``'s whole prompt is in its slot and its first token out."""
        self.metrics.count(self.metrics.prompt_tokens, len(seq.prompt))
        if self.prefix is not None:
            self.metrics.count(self.metrics.prefix_queries, len(seq.prompt))
            self.metrics.count(self.metrics.prefix_hits, seq.cached)
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
        """Steps of this decode call: ``decode_steps`` when no running sequence needs the host for its next
        token, each has room for them, and no prompt could be prefilled meanwhile; else 1."""
        steps = self.executor.decode_steps
        if steps == 1 or (self.scheduler.free and (self.scheduler.waiting or self._inbox)):
            return 1  # a prompt that could start now would wait for the whole call
        if any(s.prefilling for s in self.scheduler.running.values()):
            return 1  # a prompt part way through its chunks goes on next step
        if max(s.position for s in running) + steps > self.executor.max_model_len:
            return 1
        if any(choice.on_host(s) for s in running):
            return 1  # penalties, logprobs, grammars are applied on the host, token by token
        return steps

    # -- tokens out -------------------------------------------------------------------------

    def _append(self, seq: Sequence, sampled: Sampled) -> None:
        if seq.constraint is not None and not seq.constraint.accept(sampled.token):
            self._finish(seq, "error", error=f"token {sampled.token} left the structured output's grammar")
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
        reason, stop = stop_reason(seq, sampled.token, self.eos_token_ids, self.executor.max_model_len)
        event = TokenEvent(seq.request_id, sampled.token, sampled.logprob, sampled.top, prompt_tokens=len(seq.prompt),
                           completion_tokens=len(seq.output))
        if seq.prompt_logprobs is not None:  # on the first event only
            event.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        if reason is None:
            self._pending.append((seq, event))
            return
        self._finish(seq, reason, stop, event)

    def _finish(self, seq: Sequence, reason: str, stop: int | str | None = None, event: TokenEvent | None = None,
                error: str | None = None, timed_out: bool = False) -> None:
        if self.prefix is not None and seq.slot is not None and self.scheduler.running.get(seq.slot) is seq:
            if error is None or timed_out:  # its slot keeps what was written: every token but the last
                written = seq.prompt + seq.output[:-1] if seq.output else seq.prompt[:seq.computed]
                self.prefix.hold(seq.slot, written, seq.adapter_key)
            else:  # a failed call may have left the slot half written
                self.prefix.forget(seq.slot)
        self.scheduler.release(seq)  # its slot, and its adapter's buffer slot
        with self._lock:
            self._open.pop(seq.request_id, None)
            if seq.adapter in (self.adapters.retiring if self.adapters is not None else ()) and \
                    not any(other.adapter == seq.adapter for other in self._open.values()):
                self.adapters.remove(seq.adapter)  # unloaded while this request ran: it was the last one
        seq.finish_reason, seq.stop_reason = reason, stop
        event = event or TokenEvent(seq.request_id, None, prompt_tokens=len(seq.prompt),
                                    completion_tokens=len(seq.output), prompt_logprobs=seq.prompt_logprobs)
        event.finish_reason, event.stop_reason, event.error, event.timed_out = reason, stop, error, timed_out
        self.metrics.count(self.metrics.finished(reason))
        self.metrics.observe(self.metrics.e2e, time.perf_counter() - seq.arrival)
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
        if self.adapters is not None:
            self.metrics.lora_requests(
                self.adapters.max_loras,
                ",".join(sorted({s.adapter for s in self.scheduler.running.values() if s.adapter is not None})),
                ",".join(sorted({s.adapter for s in self.scheduler.waiting if s.adapter is not None})))

