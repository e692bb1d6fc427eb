"""Iteration-level scheduling over KV-cache slots (continuous batching, as in Orca and vLLM).

Every engine step asks :meth:`Scheduler.schedule` for one :class:`~.plan.StepPlan`, everything the
step holds as data (``plan.py``), and executes it (``engine.py``). The policy, in one place:

1. **Decode rows first.** Every running sequence whose prompt is in its slot decodes one token
   in a single compiled call (``decode_steps`` when nothing else waits). Each row costs one
   token of the step's budget, ``max_num_batched_tokens``; decoding is never starved.
2. **Admission.** Waiting prompts, oldest first, take a free slot (the lowest; with prefix caching,
   the slot holding their longest cached prefix, or a copy of it) while they may start: one that
   names a LoRA adapter needs a buffer slot for it (``max_loras``: written onto the core now, or
   it waits for one to free), one that asks for its prompt logprobs needs that model compiled (it
   is queued; the prompt waits, the ones behind go ahead). One that can never start fails.
3. **Prompt tokens fill the rest of the budget.** Without chunked prefill, admitted prompts are
   prefilled whole while the step's prompt tokens stay within the budget (the first prompt of a
   step always goes, so a longer one still runs, alone): those from position 0 together, longest
   first, in calls of as many prompts as a compiled prefill takes (``prefill_batch_buckets``), so
   prompts arriving together do not queue one behind another; one after a cached prefix, or
   asking for its prompt logprobs, in a call of its own. With
   ``enable_chunked_prefill``, a prompt is admitted only while fewer than
   ``max_num_partial_prefills`` are part way through their prefill, and its tokens go in chunks:
   one chunk a step, in the same compiled call as the decode rows (a mixed call, ``runner/mixed.py``),
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

The default budget, ``max_model_len`` tokens, is what the largest prefill call holds; with chunked
prefill it is a quarter of ``max_model_len`` (at least 32 tokens: the chunk) plus a token for every
slot.

The scheduler owns the slots, the waiting queue and the prefix cache (its only writer: what a slot
holds is recorded as a prompt is placed, written and ended) and takes and gives back adapters'
buffer slots; states.py tells it when a request's prompt is written (:meth:`wrote`) or it ends
(:meth:`release`).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Protocol

from .plan import Admit, Chunk, Decode, Mixed, Move, Prefill, PrefillBatch, StepPlan
from .request import Sequence, Status

if TYPE_CHECKING:
    from ..lora.adapters import Adapters
    from .prefix_cache import PrefixCache


class Models(Protocol):
    """What the scheduler asks of the compiled models (the executor)."""

    def can_score(self, length: int) -> bool:
        """Whether a prompt of ``length`` tokens can be prefilled with every position's logits now (if not, that
        model is queued to compile); InvalidInput if it never can."""

    def chunk_capacity(self, rows: int) -> int:
        """The longest chunk a compiled mixed model takes beside ``rows`` decode rows (0: none compiled yet)."""

    def rows_bucket(self, rows: int) -> int:
        """The decode bucket that ``rows`` rows run in."""

    def prefill_rows(self, length: int) -> list[int]:
        """The prompt counts a prefill call takes with prompts of at most ``length`` tokens (compiled so far)."""


def default_budget(max_model_len: int, chunked: bool, slots: int) -> int:
    """A step's tokens when model.yaml does not say (see the module docstring)."""
    return max(32, max_model_len // 4) + slots if chunked else max_model_len


class Scheduler:
    """Waiting queue, running set and free slots, and the policy of the module docstring.

    ``models`` answers what is compiled (the executor); ``adapters`` holds LoRA adapters in buffer slots
    (adapters.Adapters; None: the base model only); ``prefix`` is the prefix cache (None: off)."""

    def __init__(self, slots: int, max_num_batched_tokens: int, prefix: PrefixCache | None = None, *,
                 models: Models | None = None, adapters: Adapters | None = None, chunked: bool = False,
                 long_prefill_token_threshold: int = 0, max_num_partial_prefills: int = 1) -> None:
        # A heap: the lowest free slot is handed out first, so running sequences stay in the
        # low slots and a decode call (which covers slots 0 to the highest running) stays small.
        self.free = list(range(slots))
        self.slots = slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.prefix = prefix
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
        """This step's plan (see the module docstring); the slots it hands out and moves are taken now."""
        plan = StepPlan()
        decoding = self.decoding()
        budget = self.max_num_batched_tokens - len(decoding)
        partial = [s for s in self.running.values() if s.prefilling]
        admitted = self._admit(plan, budget, len(partial))
        chunk = None
        if not self.chunked:
            whole = admitted
        else:
            whole, chunk = self._fill(admitted, decoding, budget, partial)
        # Prompts from position 0 go first, together; each other admitted prompt is placed after the prompts admitted
        # before it are prefilled: its cached prefix may be one of theirs, copied from their slot once written.
        together = [seq for seq in whole if not seq.cached and seq.params.prompt_logprobs is None]
        plan.calls = [self._admitted(seq) for seq in admitted if seq in together]
        plan.calls += [PrefillBatch(tuple(map(self._prefill, group))) for group in self._batches(together)]
        plan.calls += [self._prefill(seq) for seq in whole if seq not in admitted and seq not in together]
        for seq in admitted:
            if seq not in together:
                plan.calls.append(self._admitted(seq))
                if seq in whole:
                    plan.calls.append(self._prefill(seq))
        if not whole and chunk is None:
            plan.calls += [self._move(seq, slot) for seq, slot in self._compaction()]
        # The rows of the step's batch call: the running ones, and the prompts prefilled whole before it (each then
        # has its first token; one that ended with it is left out when the call is made).
        rows = tuple(s.request_id for s in sorted([*decoding, *whole], key=lambda s: s.slot))
        if chunk is not None:
            plan.calls.append(Mixed(rows, chunk))
        elif rows:
            plan.calls.append(Decode(rows))
        return plan

    @staticmethod
    def _admitted(seq: Sequence) -> Admit:
        return Admit(seq.request_id, seq.slot, seq.copy_from, seq.adapter_slot or 0)

    def _batches(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """Prompts prefilled together, a list a call: filled longest first (a call pads to its first one's bucket),
        each call the fewest prompts compiled that holds all left, or the most; the calls in arrival order."""
        pending = sorted(seqs, key=lambda s: -len(s.prompt))
        batches = []
        while pending:
            counts = self.models.prefill_rows(len(pending[0].prompt)) if self.models is not None else [1]
            take = min((n for n in counts if n >= len(pending)), default=max(counts))
            batches.append(pending[:take])
            pending = pending[take:]
        order = {id(seq): i for i, seq in enumerate(seqs)}
        return sorted(batches, key=lambda batch: min(order[id(s)] for s in batch))

    @staticmethod
    def _prefill(seq: Sequence) -> Prefill:
        return Prefill(seq.request_id, seq.slot, len(seq.prompt), seq.cached, seq.params.prompt_logprobs is not None)

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
                if not seq.finished and all(rid != seq.request_id for rid, _ in plan.failed):
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
                plan.failed.append((seq.request_id, f"adapter {seq.adapter!r} was unloaded before the request "
                                                    f"started."))
                return False
            except Exception as exc:  # noqa: BLE001 - its files changed since it was loaded: this request fails
                plan.failed.append((seq.request_id, str(exc)))
                return False
            if seq.adapter_slot is None:
                return False  # every buffer slot holds an adapter that running sequences use
        if seq.params.prompt_logprobs is None or self.models is None:
            return True
        try:
            return self.models.can_score(len(seq.prompt))
        except Exception as exc:  # noqa: BLE001 - InvalidInput: this engine can never score it
            self._give_back(seq)
            plan.failed.append((seq.request_id, str(exc)))
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
        seq.wrote(seq.cached)
        self.running[seq.slot] = seq

    def _fill(self, admitted: list[Sequence], decoding: list[Sequence], budget: int,
              partial: list[Sequence]) -> tuple[list[Sequence], Chunk | None]:
        """Chunked prefill: whole prompts where nothing decodes and they fit, else one chunk in the mixed call."""
        pending = [*partial, *admitted]
        whole = []
        rest = budget
        for seq in list(pending):
            left = len(seq.prompt) - seq.computed
            go = seq.params.prompt_logprobs is not None or (not decoding and left <= rest) \
                or self._chunk_room(decoding) == 0
            if go and seq.computed == seq.cached:  # not part way: it may still go whole
                whole.append(seq)
                pending.remove(seq)
                rest -= left
        if not pending or rest <= 0:
            return whole, None
        seq = min(pending, key=lambda s: len(s.prompt) - s.computed)
        length = min(len(seq.prompt) - seq.computed, rest, self._chunk_room(decoding))
        if self.long_prefill_token_threshold > 0:
            length = min(length, self.long_prefill_token_threshold)
        if length <= 0:
            return whole, None
        return whole, Chunk(seq.request_id, seq.slot, seq.computed, length, seq.computed + length == len(seq.prompt))

    def _chunk_room(self, decoding: list[Sequence]) -> int:
        """The longest chunk a compiled mixed model takes beside these decode rows (0: none yet)."""
        if self.models is None:
            return 0
        rows = max((s.slot for s in decoding), default=0) + 1
        return self.models.chunk_capacity(rows)

    def decode_steps(self, rows: list[Sequence], most: int, max_model_len: int, arriving: bool) -> int:
        """Steps of a decode call over ``rows``: ``most`` (decode_steps) when no row needs the host for its next
        token, each has room for them, and no prompt could be prefilled meanwhile (none waiting nor
        ``arriving``); else 1."""
        if most == 1 or (self.free and (self.waiting or arriving)):
            return 1  # a prompt that could start now would wait for the whole call
        if any(s.prefilling for s in self.running.values()):
            return 1  # a prompt part way through its chunks goes on next step
        if max(s.position for s in rows) + most > max_model_len:
            return 1
        if any(s.params.on_host(len(s.output)) for s in rows):
            return 1  # penalties, logprobs, grammars are applied on the host, token by token
        return most

    # -- what a step did ------------------------------------------------------------------------

    def wrote(self, seq: Sequence, end: int) -> None:
        """``seq``'s prompt is in its slot up to ``end`` (a chunk, or the whole prompt): held by the prefix cache."""
        seq.wrote(end)
        if self.prefix is not None:
            self.prefix.hold(seq.slot, seq.prompt[:end], seq.adapter_key)

    def release(self, seq: Sequence, intact: bool = True) -> None:
        """Give ``seq``'s slot and its adapter's buffer slot back (it ended or was aborted), or take it off the
        waiting queue. With prefix caching its slot keeps what was written (every token but the last), unless
        it is not ``intact`` (a failed call may have left it half written)."""
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            if self.prefix is not None and intact:
                written = seq.prompt + seq.output[:-1] if seq.output else seq.prompt[:seq.computed]
                self.prefix.hold(seq.slot, written, seq.adapter_key)
            elif self.prefix is not None:
                self.prefix.forget(seq.slot)
            del self.running[seq.slot]
            heapq.heappush(self.free, seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._give_back(seq)

    # -- slots ----------------------------------------------------------------------------------

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

    def would_compact(self) -> bool:
        """Whether the next plan moves running rows into a smaller decode bucket (a step that only decodes them
        must plan first)."""
        return bool(self._compaction())

    def _move(self, seq: Sequence, slot: int) -> Move:
        """``seq`` takes free slot ``slot`` (the runner copies its cache there before the step's batch call) and
        its old slot is free."""
        move = Move(seq.request_id, seq.slot, slot)
        if self.prefix is not None:
            self.prefix.copy(seq.slot, slot)
        self.free.remove(slot)
        heapq.heapify(self.free)
        del self.running[seq.slot]
        heapq.heappush(self.free, seq.slot)
        seq.slot = slot
        self.running[slot] = seq
        return move

    def decoding(self) -> list[Sequence]:
        """The running sequences past their prompt, in slot order (one row each in the decode call)."""
        return [self.running[slot] for slot in sorted(self.running) if self.running[slot].status is Status.RUNNING]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
