"""What a replica and the generation engines share: token events, results, the request checks, admission.

The replica's generate path imports only this module (and sampling's parameters), never
the compile stack: the engines may run in a process of their own (``process.py``), and
the serving edge speaks to them through :class:`Streams` (``submit``, ``abort``, and
the async and batch APIs over them) whichever side of the process boundary they are on.
:class:`Admission` is where a request is let in or refused (its id, the capacity, a
closing or ended engine), the same for an engine, a group of engines and an engine process.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence as Seq

from ..errors import InvalidInput, ModelNotReady, Overloaded
from .mailbox import Mailbox
from .sampling import SamplingParams


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
    # With prompt_logprobs, on the request's first event: per prompt token, None (the first) or
    # (its logprob, the top alternatives as (token, logprob)).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None

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
    prompt_logprobs: list | None = None  # as TokenEvent's, when asked for


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
    biased = [t for t, _ in params.logit_bias if not 0 <= t < vocab_size]
    if biased:
        raise InvalidInput(f"logit_bias: token id {biased[0]} is outside the vocabulary (0 to {vocab_size - 1}).")
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
            scored: list = []

            def sink(event: TokenEvent) -> None:
                if event.prompt_logprobs is not None:
                    scored.append(event.prompt_logprobs)
                if event.token is not None:
                    tokens.append(event.token)
                    logprobs.append(event.logprob)
                if event.finished:
                    results[index] = Completion(event.request_id, prompt, tokens, event.finish_reason,
                                                event.stop_reason, logprobs, event.text,
                                                scored[0] if scored else None)
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


class Admission:
    """Open requests by id, at most ``slots`` running plus ``max_waiting`` waiting; see the module docstring.

    ``lock`` is the owner's lock when it guards more than the requests (the engine's wake-up).
    """

    def __init__(self, slots: int, max_waiting: int | None, lock: threading.Lock | None = None) -> None:
        self.slots = slots
        self.capacity = slots + max_waiting if max_waiting is not None else None
        self.lock = lock or threading.Lock()
        self.open: dict[str, Any] = {}
        self._ids = itertools.count()
        self.closing = False
        self.ended: str | None = None  # why the engines are gone, once they are

    def admit(self, request_id: str | None, value: Any, then: Callable[[str], None] | None = None) -> str:
        """Record ``value`` under ``request_id`` (or a new id), and run ``then(id)`` under the lock; or refuse."""
        with self.lock:
            if self.ended is not None:
                raise ModelNotReady(f"the generation engine process has ended ({self.ended}); the replica is being "
                                    f"replaced, retry shortly.")
            if self.closing:
                raise Overloaded("the generation engine is stopping; retry on another replica.")
            if self.capacity is not None and len(self.open) >= self.capacity:
                raise Overloaded(f"the generation queue is full ({len(self.open) - self.slots} requests waiting); "
                                 f"retry later.")
            rid = request_id if request_id is not None else f"gen-{next(self._ids)}"
            if rid in self.open:
                raise InvalidInput(f"request id {rid!r} is already running; give each request its own id.")
            self.open[rid] = value
            if then is not None:
                try:
                    then(rid)
                except BaseException:
                    del self.open[rid]
                    raise
        return rid

    def get(self, request_id: str) -> Any:
        with self.lock:
            return self.open.get(request_id)

    def pop(self, request_id: str) -> Any:
        """Forget a request that ended; its value, or None."""
        with self.lock:
            return self.open.pop(request_id, None)

    def close(self) -> list[str]:
        """Refuse new requests from now on; the ids still open."""
        with self.lock:
            self.closing = True
            return list(self.open)

    def end(self, reason: str) -> dict[str, Any]:
        """The engines are gone (``reason``): refuse with ModelNotReady from now on; what was open."""
        with self.lock:
            self.ended = reason
            left, self.open = self.open, {}
            return left

    def __len__(self) -> int:
        return len(self.open)


class Dispatcher(Streams):
    """Streams over several members (engines, engine processes): each request goes to the member
    :meth:`choose` picks; request ids are checked here, each member bounds its own queue."""

    def __init__(self) -> None:
        self.admission = Admission(0, None)

    @abc.abstractmethod
    def choose(self) -> Streams:
        """The member the next request goes to."""

    def submit(self, prompt: Seq[int], params: SamplingParams, sink: Callable[[TokenEvent], None],
               request_id: str | None = None) -> str:
        member = self.choose()
        rid = self.admission.admit(request_id, member)

        def forget(event: TokenEvent) -> None:
            if event.finished:
                self.admission.pop(rid)
            sink(event)

        try:
            return member.submit(prompt, params, forget, rid)
        except Exception:
            self.admission.pop(rid)
            raise

    def abort(self, request_id: str) -> None:
        member = self.admission.get(request_id)
        if member is not None:
            member.abort(request_id)
