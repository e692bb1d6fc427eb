"""Iteration-level scheduling over KV-cache slots (continuous batching, as in Orca and vLLM).

Every engine step asks :meth:`Scheduler.schedule` for one :class:`StepPlan`, everything the step
holds, and executes it (``engine.py``). The policy, in one place:

1. **Decode rows first.** Every running sequence whose prompt is in its slot decodes one token
   in a single compiled call (``decode_steps`` when nothing else waits). Each row costs one
   token of the step's budget, ``max_num_batched_tokens``; decoding is never starved.
2. **Admission.** Waiting prompts, oldest first, take a free slot (the lowest; with prefix caching,
   the slot holding their longest cached prefix, or a copy of it) while they may start: one that
   names a LoRA adapter needs a buffer slot for it (``max_loras``: written onto the core now, or
   it waits for one to free), one that asks for its prompt logprobs needs that model compiled (it
   is queued; the prompt waits, the ones behind go ahead). One that can never start fails.
3. **Prompt tokens fill the rest of the budget.** Without chunked prefill, each admitted prompt
   is prefilled whole, in a call of its own, while the step's prompt tokens stay within the
   budget (the first prompt of a step always goes, so a longer one still runs, alone). With
   ``enable_chunked_prefill``, a prompt is admitted only while fewer than
   ``max_num_partial_prefills`` are part way through their prefill, and its tokens go in chunks:
   one chunk a step, in the same compiled call as the decode rows (a mixed call, ``mixed.py``),
   at most the budget left by the rows, ``long_prefill_token_threshold`` (when above 0) and the
   largest compiled chunk; of the prompts part way, the one with the fewest tokens left goes
   first, so a short prompt is not held behind a long one. A step with no decode row prefills a
   prompt that fits the budget whole, as without chunking; a prompt asking for its logprobs is
   always prefilled whole (its compiled model keeps every position's logits). Until a mixed model
   is compiled (the background compile), prompts are prefilled whole.
4. **Compaction.** When no prompt waits or is part way, and the running sequences would fit a
   smaller decode bucket, the ones above it move down into free slots below it (their cache slots
   copied on the core), so sequences ending out of slot order stop holding every step at the
   bucket of the highest slot.
5. A sequence that ends (EOS, a stop token or string, ``max_tokens``, a full context, an abort)
   gives its slot and its adapter's buffer slot back at once (:meth:`release`).

The default budget, a quarter of ``max_model_len`` (at least 32 tokens), admits about one prompt
per step when prompts are long; with chunked prefill it is that (the chunk) plus a token for every
slot. The scheduler is bookkeeping over :class:`Sequence` objects; the engine runs the calls.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from collections import deque
from typing import Any, Callable, Protocol

from .sampling import SamplingParams


@dataclass
class Sequence:
    """One generate request from submission to its end."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Any], None]  # receives each TokenEvent (from the engine's thread)
    arrival: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_logprobs: list | None = None  # with params.prompt_logprobs: handed out on the first event
    constraint: Any = None  # with params.structured: its structured.RowConstraint
    cached: int = 0  # prompt tokens whose keys and values its slot holds already (prefix caching)
    computed: int = 0  # prompt tokens written into its slot so far (a chunked prompt's grow chunk by chunk)
    copy_from: int | None = None  # the slot to copy into its own before its prefill (a running sequence's)
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    adapter_key: Any = None  # what its prefix is cached under (adapters.Adapters.key)
    adapter_slot: int | None = None  # the buffer slot holding its adapter, once it holds one (it then counts as a user)

    @property
    def length(self) -> int:
        """Tokens the sequence holds: prompt and output."""
        return len(self.prompt) + len(self.output)

    @property
    def position(self) -> int:
        """Where its last token goes when it is fed back: the next cache position to write."""
        return self.length - 1

    @property
    def prefilling(self) -> bool:
        """Holding a slot with part of its prompt still to write (a chunked prompt between its chunks)."""
        return self.slot is not None and not self.output and self.computed < len(self.prompt)


@dataclass(frozen=True)
class Chunk:
    """The next ``length`` prompt tokens of ``seq`` from ``start``, in the step's mixed call."""

    seq: Sequence
    start: int
    length: int

    @property
    def tokens(self) -> list[int]:
        return self.seq.prompt[self.start:self.start + self.length]

    @property
    def last(self) -> bool:
        """Whether it ends its prompt (its last token's logits give the first output token)."""
        return self.start + self.length == len(self.seq.prompt)


@dataclass
class StepPlan:
    """Everything one engine step holds, as :meth:`Scheduler.schedule` decided it."""

    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # end with this error, never started
    admitted: list[Sequence] = field(default_factory=list)  # given a slot this step (copies, adapters to place)
    prefills: list[Sequence] = field(default_factory=list)  # prompts prefilled whole, each in a call of its own
    chunk: Chunk | None = None  # a prompt's next chunk, in one mixed call with the decode rows
    decode: list[Sequence] = field(default_factory=list)  # rows decoding this step, in slot order
    moves: list[tuple[Sequence, int]] = field(default_factory=list)  # compaction: (sequence, free slot below)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens this step computes (a prefix cached already costs none)."""
        whole = sum(len(s.prompt) - s.cached for s in self.prefills)
        return whole + (self.chunk.length if self.chunk is not None else 0)


class Models(Protocol):
    """What the scheduler asks of the compiled models (the executor)."""

    def can_score(self, length: int) -> bool:
        """Whether a prompt of ``length`` tokens can be prefilled with every position's logits now (if not, that
        model is queued to compile); InvalidInput if it never can."""

    def chunk_capacity(self, rows: int) -> int:
        """The longest chunk a compiled mixed model takes beside ``rows`` decode rows (0: none compiled yet)."""

    def rows_bucket(self, rows: int) -> int:
        """The decode bucket that ``rows`` rows run in."""


def default_budget(max_model_len: int) -> int:
    """Prompt tokens prefilled per step when model.yaml does not say (see the module docstring)."""
    return max(32, max_model_len // 4)


class Scheduler:
    """Waiting queue, running set and free slots, and the policy of the module docstring.

    ``models`` answers what is compiled (the executor); ``adapters`` holds LoRA adapters in buffer slots
    (adapters.Adapters; None: the base model only); ``prefix`` is the prefix cache (None: off)."""

    def __init__(self, slots: int, max_num_batched_tokens: int, prefix: Any = None, *, models: Models | None = None,
                 adapters: Any = None, chunked: bool = False, long_prefill_token_threshold: int = 0,
                 max_num_partial_prefills: int = 1) -> None:
        # A heap: the lowest free slot is handed out first, so running sequences stay in the
        # low slots and a decode call (which covers slots 0 to the highest running) stays small.
        self.free = list(range(slots))
        self.slots = slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.prefix = prefix  # a PrefixCache, with prefix caching
        self.models = models
        self.adapters = adapters
        self.chunked = chunked
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_partial_prefills = max_num_partial_prefills

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (the engine bounds the queue when a request is submitted)."""
        self.waiting.append(seq)

    # -- the plan -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """This step's plan (see the module docstring)."""
        plan = StepPlan()
        decoding = self.decoding()
        budget = self.max_num_batched_tokens - len(decoding)
        partial = [s for s in self.running.values() if s.prefilling]
        plan.admitted = self._admit(plan, budget, len(partial))
        if not self.chunked:
            plan.prefills = plan.admitted
        else:
            self._fill(plan, decoding, budget, partial)
        # The rows of the step's decode call: the running ones, and the prompts prefilled whole before it (each then
        # has its first token; one that ended with it is left out when the call is made).
        plan.decode = sorted([*decoding, *plan.prefills], key=lambda s: s.slot)
        if not plan.prefills and plan.chunk is None:
            plan.moves = self._compaction()
        return plan

    def _admit(self, plan: StepPlan, budget: int, partial: int) -> list[Sequence]:
        """Waiting sequences given a slot this step; one not startable yet keeps its place, the ones behind go
        ahead."""
        admitted: list[Sequence] = []
        skipped: list[Sequence] = []
        tokens = 0
        while self.waiting and self.free:
            if self.chunked and partial + len(admitted) >= self.max_num_partial_prefills:
                break
            seq = self.waiting.popleft()
            if not self._startable(seq, plan):
                if seq.finish_reason is None and all(s is not seq for s, _ in plan.failed):
                    skipped.append(seq)
                continue
            src, cached = None, 0
            if self.prefix is not None and seq.params.prompt_logprobs is None:  # prompt logprobs need every position
                src, cached = self.prefix.match(seq.prompt, prefer=self.free, key=seq.adapter_key)
            if not self.chunked and admitted and tokens + len(seq.prompt) - cached > self.max_num_batched_tokens:
                self.waiting.appendleft(seq)  # its adapter's buffer slot stays taken: it goes next step
                break
            self._place(seq, src, cached)
            tokens += len(seq.prompt) - seq.cached
            admitted.append(seq)
        self.waiting.extendleft(reversed(skipped))
        return admitted

    def _startable(self, seq: Sequence, plan: StepPlan) -> bool:
        """Whether ``seq`` may start now: its adapter in a buffer slot (taken now) and its model compiled; one that
        can never start is put in ``plan.failed`` with the reason."""
        if seq.adapter is not None and seq.adapter_slot is None:
            try:
                seq.adapter_slot = self.adapters.acquire(seq.adapter)
            except KeyError:  # unloaded while it waited
                plan.failed.append((seq, f"adapter {seq.adapter!r} was unloaded before the request started."))
                return False
            except Exception as exc:  # noqa: BLE001 - its files changed since it was loaded: this request fails
                plan.failed.append((seq, str(exc)))
                return False
            if seq.adapter_slot is None:
                return False  # every buffer slot holds an adapter that running sequences use
        if seq.params.prompt_logprobs is None or self.models is None:
            return True
        try:
            return self.models.can_score(len(seq.prompt))
        except Exception as exc:  # noqa: BLE001 - InvalidInput: this engine can never score it
            self._give_back(seq)
            plan.failed.append((seq, str(exc)))
            return False

    def _give_back(self, seq: Sequence) -> None:
        """Release the adapter buffer slot a sequence took but will not use this step."""
        if seq.adapter_slot is not None:
            self.adapters.release(seq.adapter_slot)
            seq.adapter_slot = None

    def _place(self, seq: Sequence, src: int | None, cached: int) -> None:
        if self.prefix is None:
            seq.slot = heapq.heappop(self.free)
        else:
            seq.slot = src if src in self.free else self.prefix.empty_first(self.free)
            self.free.remove(seq.slot)
            heapq.heapify(self.free)
            seq.cached, seq.copy_from = cached, (src if src is not None and src != seq.slot else None)
            # It holds what is written: the cached prefix now, each chunk as it is written (a copy of it taken
            # meanwhile would copy keys not written yet).
            self.prefix.hold(seq.slot, seq.prompt[:cached] if self.chunked else seq.prompt, seq.adapter_key)
        seq.computed = seq.cached
        self.running[seq.slot] = seq

    def _fill(self, plan: StepPlan, decoding: list[Sequence], budget: int, partial: list[Sequence]) -> None:
        """Chunked prefill: whole prompts where nothing decodes and they fit, else one chunk in the mixed call."""
        pending = [*partial, *plan.admitted]
        rest = budget
        for seq in list(pending):
            left = len(seq.prompt) - seq.computed
            whole = seq.params.prompt_logprobs is not None or (not decoding and left <= rest) \
                or self._chunk_room(decoding) == 0
            if whole and seq.computed == seq.cached:  # not part way: it may still go whole
                plan.prefills.append(seq)
                pending.remove(seq)
                rest -= left
        if not pending or rest <= 0:
            return
        seq = min(pending, key=lambda s: len(s.prompt) - s.computed)
        length = min(len(seq.prompt) - seq.computed, rest, self._chunk_room(decoding))
        if self.long_prefill_token_threshold > 0:
            length = min(length, self.long_prefill_token_threshold)
        if length > 0:
            plan.chunk = Chunk(seq, seq.computed, length)

    def _chunk_room(self, decoding: list[Sequence]) -> int:
        """The longest chunk a compiled mixed model takes beside these decode rows (0: none yet)."""
        if self.models is None:
            return 0
        rows = max((s.slot for s in decoding), default=0) + 1
        return self.models.chunk_capacity(rows)

    def wrote(self, seq: Sequence, end: int) -> None:
        """``seq``'s prompt is in its slot up to ``end`` (a chunk, or the whole prompt): held by the prefix cache."""
        seq.computed = end
        if self.prefix is not None:
            self.prefix.hold(seq.slot, seq.prompt[:end], seq.adapter_key)

    # -- slots ----------------------------------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """Give ``seq``'s slot and its adapter's buffer slot back (it ended or was aborted), or take it off the
        waiting queue."""
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            heapq.heappush(self.free, seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._give_back(seq)

    def _compaction(self) -> list[tuple[Sequence, int]]:
        """Moves (sequence, free slot) that bring the running sequences into the smallest decode bucket their
        number fits. None while prompts wait or are part way: the next prefills fill the lowest free slots."""
        if self.waiting or not self.running or self.models is None or \
                any(s.prefilling for s in self.running.values()):
            return []
        bucket = self.models.rows_bucket
        target = bucket(len(self.running))
        if target >= bucket(max(self.running) + 1):
            return []
        above = sorted(slot for slot in self.running if slot >= target)
        below = sorted(slot for slot in self.free if slot < target)
        return [(self.running[src], dst) for src, dst in zip(above, below)]

    def move(self, seq: Sequence, slot: int) -> None:
        """Record that ``seq`` now holds free slot ``slot`` (its cache was copied there) and its old slot is free."""
        self.free.remove(slot)
        heapq.heapify(self.free)
        del self.running[seq.slot]
        heapq.heappush(self.free, seq.slot)
        seq.slot = slot
        self.running[slot] = seq

    def decoding(self) -> list[Sequence]:
        """The running sequences past their prompt, in slot order (one row each in the decode call)."""
        return [self.running[slot] for slot in sorted(self.running) if not self.running[slot].prefilling]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
