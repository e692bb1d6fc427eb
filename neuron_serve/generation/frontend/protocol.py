"""What the front end and the engines share: requests, token events, and the streaming API over them.

The replica imports only this module, the front end and sampling's parameters, never the
compile stack: the engines may run in a process of their own (``process/client.py``). An
:class:`EngineRequest` is what the front end (``processor.py``) decided: checked token
ids, parameters with their seed, a compiled grammar; an engine takes it as it is.
"""

from __future__ import annotations

import abc
import asyncio
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence as Seq

from .mailbox import Mailbox
from ..sample.sampling import SamplingParams


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
    error_status: int = 500  # the HTTP status ``error`` is answered with (404: an adapter unloaded meanwhile)
    text: str = ""  # the output text this event adds (the front end's, with a tokenizer; never a stop string)
    timed_out: bool = False  # an abort because the request ran past the engine's request_timeout_s (last event)
    # With prompt_logprobs, on the request's first event: per prompt token, None (the first) or
    # (its logprob, the top alternatives as (token, logprob)).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineRequest:
    """A request as the front end admitted it: the engine checks nothing of it again."""

    request_id: str
    prompt: list[int]
    params: SamplingParams  # a sampled request's seed is set (drawn by the front end when not given)
    grammar: str | None = None  # the structured output's compiled grammar, serialized (xgrammar JSON)
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)


@dataclass
class Completion:
    """A whole request's result, as :meth:`Streams.generate_batch` returns it."""

    request_id: str
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[float | None] = field(default_factory=list)
    text: str | None = None  # with a tokenizer: the output's text
    prompt_logprobs: list | None = None  # as TokenEvent's, when asked for


class Engines(abc.ABC):
    """Engines that take admitted requests: one engine, a group, or an engine process."""

    @abc.abstractmethod
    def submit(self, request: EngineRequest, sink: Callable[[TokenEvent], None]) -> None:
        """Queue ``request``; ``sink`` gets its events on an engine's (or the process reader's) thread."""

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request: its last event has finish_reason ``reason``; its slot is free at the next step."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop; requests still open end with finish_reason "abort"."""

    def load_adapter(self, name: str, path: str) -> None:
        """Serve LoRA adapter ``name`` from PEFT directory ``path`` (AdapterError names the file and the reason)."""
        raise NotImplementedError("these engines serve no LoRA adapters")

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (its running requests finish on it); KeyError if it is not loaded."""
        raise NotImplementedError("these engines serve no LoRA adapters")


class Dispatcher(Engines):
    """Engines over several members (engines, engine processes): each request goes to the member
    :meth:`choose` picks, and its abort to the same one."""

    def __init__(self) -> None:
        self._members: dict[str, Engines] = {}
        self._lock = threading.Lock()

    @abc.abstractmethod
    def choose(self) -> Engines:
        """The member the next request goes to."""

    def submit(self, request: EngineRequest, sink: Callable[[TokenEvent], None]) -> None:
        member = self.choose()
        rid = request.request_id
        with self._lock:
            self._members[rid] = member

        def forget(event: TokenEvent) -> None:
            if event.finished:
                with self._lock:
                    self._members.pop(rid, None)
            sink(event)

        try:
            member.submit(request, forget)
        except BaseException:
            with self._lock:
                self._members.pop(rid, None)
            raise

    def abort(self, request_id: str, reason: str = "abort") -> None:
        with self._lock:
            member = self._members.get(request_id)
        if member is not None:
            member.abort(request_id, reason)


class Streams(abc.ABC):
    """The async and batch APIs over ``submit`` and ``abort`` (the front end's)."""

    @abc.abstractmethod
    def submit(self, prompt: Seq[int], params: SamplingParams, sink: Callable[[TokenEvent], None],
               request_id: str | None = None, adapter: str | None = None) -> str:
        """Check and queue a request (run with LoRA adapter ``adapter``, None: the base model); ``sink`` gets its
        events on an engine thread. Returns the request id."""

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
                       request_id: str | None = None, adapter: str | None = None) -> AsyncIterator[TokenEvent]:
        """An async stream of the request's events; leaving the stream early aborts the request."""
        mailbox = self._mailbox()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:
            mailbox.post(queue.put_nowait, event)  # one wake-up of the loop for a step's events

        rid = self.submit(prompt, params, sink, request_id, adapter)
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
                       timeout: float | None = None,
                       adapters: str | None | Seq[str | None] = None) -> list[Completion]:
        """Generate for every prompt at once (continuous batching) and wait; results in prompt order. ``adapters``:
        the LoRA adapter of every prompt, or of each (None: the base model)."""
        every = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        named = list(adapters) if isinstance(adapters, (list, tuple)) else [adapters] * len(prompts)
        done = threading.Semaphore(0)
        results: list[Completion | None] = [None] * len(prompts)

        def collect(index: int, prompt: list[int]) -> Callable[[TokenEvent], None]:
            tokens: list[int] = []
            logprobs: list[float | None] = []
            scored: list = []
            text: list[str] = []

            def sink(event: TokenEvent) -> None:
                if event.prompt_logprobs is not None:
                    scored.append(event.prompt_logprobs)
                if event.token is not None:
                    tokens.append(event.token)
                    logprobs.append(event.logprob)
                text.append(event.text)
                if event.finished:
                    results[index] = Completion(event.request_id, prompt, tokens, event.finish_reason,
                                                event.stop_reason, logprobs, "".join(text),
                                                scored[0] if scored else None)
                    done.release()
            return sink

        ids = [self.submit(prompt, p, collect(i, list(prompt)), adapter=a)
               for i, (prompt, p, a) in enumerate(zip(prompts, every, named))]
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in prompts:
            if not done.acquire(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
                for rid, result in zip(ids, results):
                    if result is None:  # nobody waits for it any more: its slot goes back
                        self.abort(rid)
                raise TimeoutError(f"generate_batch: not finished within {timeout}s; the unfinished requests "
                                   f"were aborted")
        return [r for r in results if r is not None]
