"""The front end of the engines: the one place a generate request is checked and admitted, its grammar
compiled, and its output detokenized and cut at stop strings (vLLM v1's processor and output processor).

It runs where the requests arrive (the replica; or beside the engine, in process, for
``engine_for``) and hands the engines an :class:`~.protocol.EngineRequest` they take as it
is: token ids in the vocabulary and within ``max_model_len``, parameters with their seed,
a compiled grammar. Token-level ends (EOS, stop token ids, ``max_tokens``, a full context)
are the engine's; a stop string is found here, in the text, and the request is aborted in
the engine with reason "stop" (a step or two of tokens past it are computed for nothing,
as in vLLM). Admission bounds what is open: every engine's slots and its waiting queue.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import threading
from typing import Any, Callable, Sequence as Seq

from ...errors import InvalidInput, Overloaded
from .protocol import EngineRequest, Engines, Streams, TokenEvent
from ..sample.sampling import SamplingParams
from .text import IncrementalText


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
    if params.structured is not None and not has_tokenizer:
        raise InvalidInput("structured outputs need a tokenizer; this engine has none.")
    return ids


class Admission:
    """Open requests by id, at most ``capacity`` of them; see the module docstring."""

    def __init__(self, capacity: int | None, queue: int = 0) -> None:
        self.capacity = capacity
        self.queue = queue  # of the capacity, how many may wait for a slot (named in the refusal)
        self.lock = threading.Lock()
        self.open: dict[str, Any] = {}
        self._ids = itertools.count()
        self.closing = False

    def admit(self, request_id: str | None, value: Any, then: Callable[[str], None]) -> str:
        """Record ``value`` under ``request_id`` (or a new id) and run ``then(id)`` under the lock; or refuse."""
        with self.lock:
            if self.closing:
                raise Overloaded("the generation engine is stopping; retry on another replica.")
            if self.capacity is not None and len(self.open) >= self.capacity:
                raise Overloaded(f"the generation queue is full ({self.queue} requests waiting); retry later.")
            rid = request_id if request_id is not None else f"gen-{next(self._ids)}"
            if rid in self.open:
                raise InvalidInput(f"request id {rid!r} is already running; give each request its own id.")
            self.open[rid] = value
            try:
                then(rid)
            except BaseException:
                del self.open[rid]
                raise
        return rid

    def pop(self, request_id: str) -> Any:
        """Forget a request that ended; its value, or None."""
        with self.lock:
            return self.open.pop(request_id, None)

    def get(self, request_id: str) -> Any:
        with self.lock:
            return self.open.get(request_id)

    def close(self) -> None:
        with self.lock:
            self.closing = True

    def __len__(self) -> int:
        return len(self.open)


@dataclasses.dataclass
class _Open:
    """One admitted request's output: its text so far, and whether its consumer has had its last event."""

    text: IncrementalText | None
    min_tokens: int
    finished: bool = False


class Frontend(Streams):
    """Requests in, token events with their text out, over ``engines`` (see the module docstring).

    ``info`` describes the engines: ``engines``, ``slots``, ``max_waiting`` (per engine),
    ``vocab_size``, ``max_model_len``, ``eos_token_ids``.
    """

    def __init__(self, engines: Engines, info: dict, tokenizer: Any = None) -> None:
        self.engines = engines
        self.info = info
        self.tokenizer = tokenizer
        self.vocab_size: int = info["vocab_size"]
        self.max_model_len: int = info["max_model_len"]
        self.slots: int = info["slots"]
        count = info["engines"]
        self.admission = Admission(count * (self.slots + info["max_waiting"]), count * info["max_waiting"])
        self._grammars: Any = None
        self._compiled: dict[str, str] = {}  # a constraint's key -> its grammar, serialized
        self._grammar_lock = threading.Lock()

    # -- requests in ------------------------------------------------------------------------

    def submit(self, prompt: Seq[int], params: SamplingParams, sink: Callable[[TokenEvent], None],
               request_id: str | None = None, adapter: str | None = None) -> str:
        ids = check_prompt(prompt, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                           has_tokenizer=self.tokenizer is not None)
        grammar = self.compile_grammar(params.structured) if params.structured is not None else None
        if not params.greedy and params.seed is None:  # its own stream from here on, wherever it is chosen
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        state = _Open(IncrementalText(self.tokenizer, params.stop) if self.tokenizer is not None else None,
                      params.min_tokens)
        return self.admission.admit(request_id, state, lambda rid: self.engines.submit(
            EngineRequest(rid, ids, params, grammar, adapter), self._output(rid, state, sink)))

    def abort(self, request_id: str) -> None:
        if self.admission.get(request_id) is not None:
            self.engines.abort(request_id)

    @property
    def alive(self) -> bool:
        """False once the engines can serve no more (their process has ended)."""
        return getattr(self.engines, "alive", True)

    @property
    def running(self) -> int:
        """Requests open: running or waiting for a slot."""
        return len(self.admission)

    def close(self) -> None:
        """Refuse new requests, and stop the engines (requests still open end with finish_reason "abort")."""
        self.admission.close()
        self.engines.close()

    # -- grammars ----------------------------------------------------------------------------

    def compile_grammar(self, constraint: Any) -> str:
        """``constraint`` compiled against the tokenizer, serialized for the engines; InvalidInput naming the
        request field when the grammar library refuses it. Compiled once per distinct constraint."""
        key = json.dumps([constraint.kind, constraint.spec], sort_keys=True, default=str)
        with self._grammar_lock:
            found = self._compiled.get(key)
            if found is not None:
                return found
            if self._grammars is None:
                from .structured import Grammars  # noqa: PLC0415 - only structured requests need xgrammar

                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.info.get("eos_token_ids", ()))
            compiled = self._grammars.compile(constraint).serialize_json()
            if len(self._compiled) >= 256:  # a bounded cache: the oldest goes
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = compiled
            return compiled

    # -- events out ----------------------------------------------------------------------------

    def _output(self, rid: str, state: _Open, sink: Callable[[TokenEvent], None]) -> Callable[[TokenEvent], None]:
        """The engines' sink for request ``rid``: each event gets its text; a stop string ends the request."""

        def deliver(event: TokenEvent) -> None:
            if state.finished:  # ended here by a stop string: what the engine made since is dropped
                return
            text = state.text
            if text is not None:
                if event.token is not None:
                    event.text = text.add(event.token, watch=event.completion_tokens > state.min_tokens)
                if text.stopped is not None and event.finish_reason in (None, "stop", "length"):
                    if event.finish_reason is None:  # the engine would go on: it stops at its next step
                        self.engines.abort(rid, "stop")
                    event.finish_reason, event.stop_reason = "stop", text.stopped
                elif event.finished:
                    event.text += text.finish()
            if event.finished:
                state.finished = True
                self.admission.pop(rid)
            sink(event)

        return deliver
